package outbox

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// BenchmarkWriteAndRelay compares the two outbox modes end to end in one
// run: b.N events written in transactions of 100 (10 keys, 10 events each,
// as a batch of records emits them), then relayed to a fresh stream until
// the stream holds them all. It reports the write and the relay time per
// event, and the CPU-seconds per 10k events of this process (the writer
// and the relay; Postgres's and NATS's own CPU is not in it).
//
//	go test -run '^$' -bench BenchmarkWriteAndRelay -benchtime 20000x ./outbox
func BenchmarkWriteAndRelay(b *testing.B) {
	for _, mode := range []Mode{ModeTable, ModeWAL} {
		b.Run(string(mode), func(b *testing.B) {
			f := newWALFixture(b)
			f.mode = mode
			ctx := context.Background()
			keys := keyNames("k", 10)
			var rows [][]Row
			for n := 0; n < b.N; n += 100 {
				rows = append(rows, f.newRows(keys, 10))
			}
			total := len(rows) * 100
			cpu0 := cpuTime()
			b.ResetTimer()
			start := time.Now()
			for _, tx := range rows {
				if err := pgx.BeginFunc(ctx, f.db.Pool, func(t pgx.Tx) error { return Write(ctx, t, mode, tx) }); err != nil {
					b.Fatal(err)
				}
			}
			wrote := time.Since(start)
			cfg := f.walConfig()
			cfg.Mode = mode
			relayStart := time.Now()
			_, stop := f.startRelay(cfg)
			for f.streamMsgs() < total {
				time.Sleep(5 * time.Millisecond)
			}
			relayed := time.Since(relayStart)
			b.StopTimer()
			cpu := cpuTime() - cpu0
			stop()
			b.ReportMetric(float64(wrote.Microseconds())/float64(total), "write-µs/event")
			b.ReportMetric(float64(relayed.Microseconds())/float64(total), "relay-µs/event")
			b.ReportMetric(float64(total)/relayed.Seconds(), "relayed/s")
			b.ReportMetric(cpu.Seconds()*10000/float64(total), "cpu-s/10k")
			b.Log(fmt.Sprintf("%s: %d events written in %v, relayed in %v", mode, total, wrote.Round(time.Millisecond), relayed.Round(time.Millisecond)))
		})
	}
}

// cpuTime is this process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkWALSessionLoop is the session loop's own cost per event (take,
// publish, ack, advance), with no Postgres and no NATS: transactions of
// 500 events, each event its own key, taken in chunks of 64 while the
// acks of the transactions 4 behind come in, as at full load (about 2,000
// events pending).
//
//	go test -run '^$' -bench BenchmarkWALSessionLoop -benchmem ./outbox
func BenchmarkWALSessionLoop(b *testing.B) {
	const perTxn, chunk, behind = 500, 64, 4
	txns := orderItems(b, 64, perTxn)
	ctx := context.Background()
	s := newLoopSession(b, nil)
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	defer func() { b.ReportMetric(float64((cpuTime()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/event") }()
	for t, events := 0, 0; events < b.N; t++ {
		items := txns[t%len(txns)]
		for len(items) > 0 {
			n := min(chunk, len(items))
			for _, it := range items[:n] {
				s.take(ctx, it)
			}
			items = items[n:]
			s.advance()
			s.nextWake()
			if t >= behind {
				s.ackOldest(ctx, chunk)
				s.advance()
				s.nextWake()
			}
		}
		events += perTxn
	}
	for s.pending > 0 {
		s.ackOldest(ctx, chunk)
		s.advance()
		s.nextWake()
	}
}
