// Command effects-worker runs the effects test function as a real process,
// for fault tests that kill, pause and restart workers. The function name and
// topic come from KFN_TEST_FUNCTION and KFN_TEST_TOPIC.
package main

import (
	"fmt"
	"os"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime"
)

func main() {
	name, topic := os.Getenv("KFN_TEST_FUNCTION"), os.Getenv("KFN_TEST_TOPIC")
	if name == "" || topic == "" {
		fmt.Fprintln(os.Stderr, "effects-worker: set KFN_TEST_FUNCTION and KFN_TEST_TOPIC")
		os.Exit(2)
	}
	runtime.Start(effects.Function(name, topic))
}
