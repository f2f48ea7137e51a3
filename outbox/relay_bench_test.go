package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// BenchmarkRelay measures, in one run: relay throughput and cost per event
// (CPU, allocations, read/write syscalls of this process) on a 50k-row
// backlog, the naive relay on the same backlog and the ratio, and commit →
// stream ack latency at 80% of the backlog throughput. NATS runs as its own
// process, as in production. It ignores b.N; run it once:
//
//	go test -run '^$' -bench BenchmarkRelay -benchtime 1x ./outbox/
func BenchmarkRelay(b *testing.B) {
	db := kfntest.Postgres(b)
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = Shards + 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	nats := kfntest.NATSProcess(b)
	_, js := connectJetStream(b, nats.URL)

	var res RelayBenchResult
	for range b.N {
		res, err = RunRelayBenchmark(context.Background(), RelayBenchConfig{
			Pool: pool, JetStream: js,
			Relay: RelayConfig{Logger: testLogger()},
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(res.RelayPerSecond, "events/s")
	b.ReportMetric(res.NaivePerSecond, "naive-events/s")
	b.ReportMetric(res.Ratio, "x-naive")
	b.ReportMetric(float64(res.LatencyP50)/float64(time.Millisecond), "p50-ms")
	b.ReportMetric(float64(res.LatencyP99)/float64(time.Millisecond), "p99-ms")
	b.ReportMetric(float64(res.RelayCost.CPU)/float64(time.Microsecond), "cpu-µs/event")
	b.ReportMetric(res.RelayCost.Allocs, "allocs/event")
	b.ReportMetric(res.RelayCost.Syscalls, "syscalls/event")
	b.Logf("\n%s", res)
}
