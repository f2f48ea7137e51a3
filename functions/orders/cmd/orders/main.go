// Command orders runs the orders function as its own process (and image).
//
// ORDERS_TOPIC, when set, replaces the topic the function consumes (the
// default is "orders"); tests use it to give each run a topic of its own on
// a shared Kafka cluster.
package main

import (
	"os"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime/worker"
)

func main() {
	fn := orders.Function()
	if topic := os.Getenv("ORDERS_TOPIC"); topic != "" {
		fn.Topic = topic
	}
	worker.Start(fn)
}
