package bench

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// BenchmarkRelay measures, in one run: relay throughput and cost per event
// (CPU, allocations, read/write syscalls of this process) on a 50k-row
// backlog, the naive relay on the same backlog and the ratio, and commit →
// stream ack latency at 50% and 80% of the maximum rate of committing
// events with the relay running (the table outbox). NATS runs as its own
// process, as in production. It ignores b.N; run it once:
//
//	go test -run '^$' -bench BenchmarkRelay -benchtime 1x ./cmd/kfn/internal/bench/
func BenchmarkRelay(b *testing.B) {
	db := kfntest.Postgres(b)
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = outbox.Shards + 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	server := kfntest.NATSProcess(b)
	nc, err := nats.Connect(server.URL, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.RetryOnFailedConnect(true))
	if err != nil {
		b.Fatalf("connect to NATS: %v", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		b.Fatal(err)
	}

	var res RelayResult
	for range b.N {
		res, err = RunRelay(context.Background(), RelayConfig{
			Pool: pool, JetStream: js,
			Relay: outbox.RelayConfig{Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))},
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(res.RelayPerSecond, "events/s")
	b.ReportMetric(res.NaivePerSecond, "naive-events/s")
	b.ReportMetric(res.Ratio, "x-naive")
	for _, m := range res.Latency {
		for _, l := range m.Loads {
			at := fmt.Sprintf("%s-%.0f%%", m.Mode, 100*l.Share)
			b.ReportMetric(float64(l.P50)/float64(time.Millisecond), at+"-p50-ms")
			b.ReportMetric(float64(l.P99)/float64(time.Millisecond), at+"-p99-ms")
		}
	}
	b.ReportMetric(float64(res.RelayCost.CPU)/float64(time.Microsecond), "cpu-µs/event")
	b.ReportMetric(res.RelayCost.Allocs, "allocs/event")
	b.ReportMetric(res.RelayCost.Syscalls, "syscalls/event")
	b.Logf("\n%s", res)
}
