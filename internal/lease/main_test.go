package lease

import (
	"testing"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestMain lets kfntest stop the separate nats-server processes it starts.
func TestMain(m *testing.M) { kfntest.Main(m) }
