package runtime_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

// bundle is what a worker test needs: real Postgres, NATS and Kafka, a
// fresh topic and a config pointing at all three.
type bundle struct {
	pg    *kfntest.PG
	kafka *kfntest.KafkaCluster
	topic string
	fn    string
	cfg   runtime.Config
}

func setup(t *testing.T, partitions int) *bundle {
	t.Helper()
	b := &bundle{pg: kfntest.Postgres(t), kafka: kfntest.Kafka(t)}
	b.topic = b.kafka.CreateTopic(t, partitions)
	b.fn = kfntest.Name(t, "fn")
	b.cfg = runtime.Config{
		KafkaBrokers:  b.kafka.Brokers,
		DatabaseURL:   b.pg.URL,
		NATSURL:       kfntest.NATSURL(t),
		LeaseBucket:   kfntest.Name(t, "leases"), // tests may differ in lease timing
		BatchSize:     100,
		BatchWait:     5 * time.Millisecond,
		RetryAttempts: 3,
		RetryInitial:  10 * time.Millisecond,
		RetryMax:      50 * time.Millisecond,
		Logger:        testLogger(t),
	}
	return b
}

// run starts a worker for fn in the background and returns a stop function
// that shuts it down cleanly and waits for it.
func (b *bundle) run(t *testing.T, fn runtime.Function) (*worker.Worker, func()) {
	t.Helper()
	w, err := worker.New(context.Background(), b.cfg, fn)
	if err != nil {
		t.Fatalf("start worker: %v", err)
	}
	return w, kfntest.Background(t, "worker", w.Run)
}

// produce writes values to one partition and returns where they landed. A
// nil value is a tombstone.
func (b *bundle) produce(t *testing.T, partition int32, values ...[]byte) []effects.Produced {
	t.Helper()
	before := b.kafka.HighWatermarks(t, b.topic)[int(partition)]
	msgs := make([]kafka.Message, len(values))
	for i, v := range values {
		msgs[i] = kafka.Message{Partition: int(partition), Key: []byte(fmt.Sprintf("k%d", i%7)), Value: v}
	}
	b.kafka.Produce(t, b.topic, msgs...)
	out := make([]effects.Produced, len(values))
	for i := range values {
		out[i] = effects.Produced{Partition: partition, Offset: before + int64(i)}
	}
	return out
}

// produceN writes n plain records to each of the partitions.
func (b *bundle) produceN(t *testing.T, partitions, n int) []effects.Produced {
	t.Helper()
	var out []effects.Produced
	for p := 0; p < partitions; p++ {
		values := make([][]byte, n)
		for i := range values {
			values[i] = []byte(fmt.Sprintf("v-%d-%d", p, i))
		}
		out = append(out, b.produce(t, int32(p), values...)...)
	}
	return out
}

// outboxHeaders returns the headers of the outbox rows (workers run with
// NoRelay keep them) by source offset, and fails the test unless there
// are want of them, one per offset.
func (b *bundle) outboxHeaders(t *testing.T, want int) map[int64]map[string]string {
	t.Helper()
	rows, err := b.pg.Pool.Query(context.Background(), `SELECT source_offset, headers FROM kfn.outbox ORDER BY source_offset`)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int64]map[string]string{}
	var off int64
	var h map[string]string
	_, err = pgx.ForEachRow(rows, []any{&off, &h}, func() error {
		out[off] = h
		h = nil
		return nil
	})
	if err != nil || len(out) != want {
		t.Fatalf("outbox rows by source offset = %v (%v), want %d, one per record", out, err, want)
	}
	return out
}

// waitCaughtUp waits until the function's cursors reach the topic's high
// watermarks.
func (b *bundle) waitCaughtUp(t *testing.T, fn string) {
	t.Helper()
	hw := b.kafka.HighWatermarks(t, b.topic)
	waitFor(t, 60*time.Second, fmt.Sprintf("%s to catch up with %v", fn, hw), func() bool {
		for p, end := range hw {
			var next int64
			err := b.pg.Pool.QueryRow(context.Background(),
				`SELECT coalesce((SELECT next_offset FROM kfn.cursors WHERE consumer = $1 AND topic = $2 AND partition = $3), -1)`,
				fn, b.topic, p).Scan(&next)
			if err != nil || next < end {
				return false
			}
		}
		return true
	})
}

// check runs the checker over fn's effects, dead letters, claim history and
// emitted events (outbox and event stream), and requires every count to be
// zero and the dead-lettered records to be exactly dead: the records the
// test knows must be dead-lettered (none if omitted). Run it once the
// worker is stopped.
func (b *bundle) check(t *testing.T, fn string, produced []effects.Produced, dead ...effects.Produced) effects.Report {
	t.Helper()
	stream := b.cfg.EventStream
	if stream == "" {
		stream = runtime.DefaultStream
	}
	rep, err := effects.Check(context.Background(), b.pg.Pool, fn, b.topic, produced, effects.Events(jetStream(t, b.cfg.NATSURL), stream))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("checker: %s", rep)
	if v := rep.Violations(dead...); len(v) > 0 {
		t.Errorf("exactly-once violated: %s", strings.Join(v, "; "))
	}
	return rep
}

// offsets lists the records of produced at the given indexes, for the
// dead letters a test expects.
func offsets(produced []effects.Produced, indexes ...int) []effects.Produced {
	out := make([]effects.Produced, len(indexes))
	for i, ix := range indexes {
		out[i] = produced[ix]
	}
	return out
}

// wantDuplicates requires that worker w skipped exactly n records as
// handled before. The high-water mark and the inbox absorb a record read
// twice without a trace in the effects, so a test that resumes or rewinds
// states what that layer had to absorb.
func wantDuplicates(t *testing.T, w *worker.Worker, n int64, why string) {
	t.Helper()
	if got := w.Stats().Duplicates.Load(); got != n {
		t.Errorf("records skipped as handled before = %d, want %d: %s", got, n, why)
	}
}

// testLogger sends the worker's warnings and errors to the test log (all
// of its logs with KFN_TEST_LOG=debug or info).
func testLogger(t *testing.T) *slog.Logger {
	level := slog.LevelWarn
	if v := os.Getenv("KFN_TEST_LOG"); v != "" {
		if err := level.UnmarshalText([]byte(v)); err != nil {
			t.Fatalf("KFN_TEST_LOG=%q: %v", v, err)
		}
	}
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: level}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func waitFor(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", limit, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func execSQL(t *testing.T, b *bundle, sql string, args ...any) {
	t.Helper()
	if _, err := b.pg.Pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}
