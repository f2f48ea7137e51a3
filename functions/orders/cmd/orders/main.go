// Command orders runs the orders function as its own process (and image).
package main

import (
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime"
)

func main() { runtime.Start(orders.Function()) }
