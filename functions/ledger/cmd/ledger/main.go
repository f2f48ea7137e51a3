// Command ledger runs the ledger function as its own process (and image).
package main

import (
	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/runtime/worker"
)

func main() { worker.Start(ledger.Function()) }
