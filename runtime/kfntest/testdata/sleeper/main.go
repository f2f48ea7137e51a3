// Command sleeper is a stand-in worker process for kfntest's own tests: it
// prints "ready", then waits for SIGTERM and exits with status 0.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM)
	fmt.Println("ready")
	<-sig
	fmt.Println("stopping")
}
