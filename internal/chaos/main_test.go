//go:build chaos

package chaos_test

import (
	"flag"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

// The run's flags, after -args: go tool task chaos -- --duration 10m.
var (
	runFor     = flag.Duration("duration", 2*time.Minute, "how long to inject faults; every fault is injected at least once, so a short run may take longer")
	intensity  = flag.Float64("intensity", 6, "faults injected per minute (each fault's window is 1/intensity minutes, at least long enough to recover)")
	jsonOut    = flag.String("json", "", "write the table to this `file` as JSON")
	only       = flag.String("only", "", "play only the faults whose names match this `regexp` (default: all)")
	outboxMode = flag.String("outbox", "table", "where the workers write their events: table, or wal (the run sets the WAL outbox up, and the relays read its slot)")
	embedded   = flag.Bool("embedded-kafka", false, "use the embedded Kafka broker even when Java and Maven could run a 3-broker cluster (the broker-kill fault is then skipped)")
)
