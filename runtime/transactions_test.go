package runtime_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/kafkasource"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/operator/verify"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// txProducer writes to one partition of b's topic (0 unless set) inside
// Kafka transactions, as Kafka Streams or Flink's exactly-once sinks do.
type txProducer struct {
	t         *testing.T
	cl        *kgo.Client
	partition int32
}

func newTxProducer(t *testing.T, b *bundle) *txProducer {
	t.Helper()
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(b.kafka.Brokers...),
		kgo.TransactionalID(kfntest.Name(t, "txn")),
		kgo.DefaultProduceTopic(b.topic),
		kgo.RecordPartitioner(kgo.ManualPartitioner()),
	)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return &txProducer{t: t, cl: cl}
}

// begin opens a transaction and writes values in it.
func (p *txProducer) begin(values ...string) {
	p.t.Helper()
	if err := p.cl.BeginTransaction(); err != nil {
		p.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, v := range values {
		if err := p.cl.ProduceSync(ctx, &kgo.Record{Partition: p.partition, Value: []byte(v)}).FirstErr(); err != nil {
			p.t.Fatalf("produce %s in a transaction: %v", v, err)
		}
	}
}

// end commits or aborts the open transaction.
func (p *txProducer) end(commit bool) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := p.cl.EndTransaction(ctx, kgo.TransactionEndTry(commit)); err != nil {
		p.t.Fatalf("end transaction (commit %v): %v", commit, err)
	}
}

// write writes values in one transaction and commits or aborts it.
func (p *txProducer) write(commit bool, values ...string) {
	p.t.Helper()
	p.begin(values...)
	p.end(commit)
}

// valueRecorder is a function that stores the offset and value of each
// record it applies in table.
func valueRecorder(b *bundle) (runtime.Function, string) {
	table := pgx.Identifier{"values_" + b.fn}.Sanitize()
	return runtime.Function{
		Name: b.fn, Topic: b.topic,
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` (source_offset bigint, value bytea)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1, $2)`, rec.Offset, rec.Value)
			return err
		},
	}, table
}

// appliedValues lists the values table holds, in offset order.
func appliedValues(t *testing.T, b *bundle, table string) []string {
	t.Helper()
	rows, err := b.pg.Pool.Query(context.Background(), `SELECT value FROM `+table+` ORDER BY source_offset`)
	if err != nil {
		t.Fatal(err)
	}
	values, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var v []byte
		err := r.Scan(&v)
		return string(v), err
	})
	if err != nil {
		t.Fatal(err)
	}
	return values
}

// TestTransactionalProducersOnlyCommittedRecordsAreApplied: a topic
// written by a transactional producer, with a plain producer writing
// between its records. The worker applies exactly the committed records
// and the plain ones, each once, in offset order: no record of an aborted
// transaction, and no transaction marker as a record. A transaction still
// open holds back what follows it (Kafka's last stable offset) until it
// ends. kfn verify's scan of the partition and the operator's record
// lookup see the same records.
func TestTransactionalProducersOnlyCommittedRecordsAreApplied(t *testing.T) {
	b := setup(t, 1)
	tx := newTxProducer(t, b)
	plain := func(v string) {
		t.Helper()
		b.kafka.Produce(t, b.topic, kafka.Message{Partition: 0, Value: []byte(v)})
	}
	tx.begin("a0", "a1", "a2")
	tx.end(true)
	tx.begin("b0", "b1")
	tx.end(false)
	tx.begin("c0")
	plain("p0") // between an aborted transaction's records and its marker
	tx.end(false)
	tx.begin("d0")
	tx.end(true)

	fn, table := valueRecorder(b)
	w, stop := b.run(t, fn)
	defer stop()

	// While a transaction is open, neither its records nor the plain
	// record after them are read.
	tx.begin("e0")
	plain("q0")
	time.Sleep(2 * time.Second)
	want := []string{"a0", "a1", "a2", "p0", "d0"}
	waitFor(t, 30*time.Second, "the records committed before the open transaction", func() bool {
		return slices.Equal(appliedValues(t, b, table), want)
	})
	tx.end(false)
	plain("end")
	tx.begin("f0") // the partition ends with its commit marker
	tx.end(true)
	want = append(want, "q0", "end", "f0")
	waitFor(t, 30*time.Second, "every committed record, once, in offset order", func() bool {
		return len(appliedValues(t, b, table)) >= len(want)
	})
	// A marker is no record to apply: the lag ends at the last record.
	waitFor(t, 10*time.Second, "no lag once the last committed record is applied", func() bool {
		return w.Stats().Lag() == 0
	})
	stop()
	if got := appliedValues(t, b, table); !slices.Equal(got, want) {
		t.Fatalf("applied %q, want %q", got, want)
	}

	// kfn verify reads the partition through the same filter.
	rows, err := b.pg.Pool.Query(context.Background(), `SELECT source_offset FROM `+table+` ORDER BY source_offset`)
	if err != nil {
		t.Fatal(err)
	}
	offsets, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	log, err := kafkasource.OpenLog(b.kafka.Brokers, runtime.KafkaSecurity{})
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	ctx := context.Background()
	_, high, err := log.OffsetRange(ctx, b.topic, 0)
	if err != nil {
		t.Fatal(err)
	}
	var scanned []int64
	if err := log.Scan(ctx, b.topic, 0, 0, high, func(offset int64, _ []byte) error {
		scanned = append(scanned, offset)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(scanned, offsets) {
		t.Errorf("the scan up to the high watermark %d found offsets %v, the worker applied %v", high, scanned, offsets)
	}

	// The operator's record lookup (kfn dlq park) finds each applied
	// record, and no record at the others: the markers and the records of
	// aborted transactions.
	for o := int64(0); o < high; o++ {
		rec, err := kafkasource.ReadRecord(ctx, b.kafka.Brokers, runtime.KafkaSecurity{}, b.topic, 0, o)
		if i := slices.Index(offsets, o); i >= 0 {
			if err != nil || string(rec.Value) != want[i] {
				t.Errorf("the record at offset %d: %q, %v; want %s", o, rec.Value, err, want[i])
			}
		} else if err == nil || !strings.Contains(err.Error(), "no committed record") {
			t.Errorf("reading offset %d, a marker or a record of an aborted transaction: got %q, err = %v; want an error that says it holds no committed record", o, rec.Value, err)
		}
	}
}

// TestTransactionalPartitionsDrainToTheLogEnd: partitions written by
// transactional producers, committed and aborted transactions
// interleaved, and left idle, one after a COMMIT marker and one after an
// aborted transaction (its records and its ABORT marker). The worker's
// cursor, kfn status's lag and the mirrored consumer group's offset all
// reach the log end offset, although no record is there to apply: a
// cursor that stopped at the last record would show a lag of one marker,
// or of an aborted transaction, for good. Then the same after a restart
// of the worker, with the partitions' tails swapped. Every committed
// record is applied once, and no aborted one.
func TestTransactionalPartitionsDrainToTheLogEnd(t *testing.T) {
	b := setup(t, 2)
	b.cfg.ConsumerGroup = kfntest.Name(t, "group")
	p0, p1 := newTxProducer(t, b), newTxProducer(t, b)
	p1.partition = 1
	plain := func(partition int, v string) {
		t.Helper()
		b.kafka.Produce(t, b.topic, kafka.Message{Partition: partition, Value: []byte(v)})
	}
	nc, err := nats.Connect(kfntest.NATSURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	fn, table := valueRecorder(b)

	// drained waits until every partition's cursor, status lag and group
	// offset reach the log end, and returns how long that took after the
	// last committed record was applied.
	drained := func(round string, want []string) time.Duration {
		t.Helper()
		waitFor(t, 30*time.Second, round+": every committed record applied", func() bool {
			return len(appliedValues(t, b, table)) >= len(want)
		})
		applied := time.Now()
		if got := appliedValues(t, b, table); !slices.Equal(sorted(got), sorted(want)) {
			t.Fatalf("%s: applied %q, want %q, each once", round, got, want)
		}
		// Kafka writes a transaction's markers after EndTransaction
		// returns: the log ends are read again on each look.
		var problem string
		deadline := time.Now().Add(30 * time.Second)
		for done := false; !done; time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the partitions did not drain to their log ends within 30s: %s", round, problem)
			}
			ends := b.kafka.HighWatermarks(t, b.topic)
			done = func() bool {
				statuses, err := operator.Status(context.Background(), b.pg.Pool, b.kafka.Brokers, js, b.cfg.LeaseBucket, b.fn)
				if err != nil || len(statuses) != len(ends) {
					problem = fmt.Sprintf("kfn status: %d lanes, %v", len(statuses), err)
					return false
				}
				group := groupOffsets(t, b, b.cfg.ConsumerGroup)
				for _, s := range statuses {
					end := ends[int(s.Partition)]
					committed := group[fmt.Sprint(s.Partition)]
					if s.Cursor != end || s.Lag != 0 || s.KafkaHighMark != end || !strings.HasPrefix(committed, fmt.Sprintf("%d ", end)) {
						problem = fmt.Sprintf("partition %d: cursor %d, status lag %d, high watermark %d, group offset %q; want the log end %d, lag 0",
							s.Partition, s.Cursor, s.Lag, s.KafkaHighMark, committed, end)
						return false
					}
				}
				return true
			}()
		}
		return time.Since(applied)
	}

	// Partition 0 ends with a COMMIT marker, partition 1 with an aborted
	// transaction; plain records sit between the transactions.
	p0.write(true, "a0", "a1")
	p0.write(false, "x0")
	plain(0, "n0")
	p0.write(true, "a2")
	plain(1, "n1")
	p1.write(true, "b0")
	p1.write(false, "y0", "y1")
	want := []string{"a0", "a1", "n0", "a2", "n1", "b0"}
	w, stop := b.run(t, fn)
	took := []time.Duration{drained("first worker", want)}

	// While the worker waits at the ends: a transaction committed on
	// partition 0, one aborted on partition 1 (a fetch that returns its
	// records and marker holds nothing to apply).
	p0.write(true, "a3")
	p1.write(false, "y2", "y3")
	want = append(want, "a3")
	took = append(took, drained("tails written while the worker waits", want))
	if s := w.Stats(); s.Duplicates.Load() != 0 || s.DeadLettered.Load() != 0 {
		t.Errorf("first worker: %d duplicates, %d dead letters; want none", s.Duplicates.Load(), s.DeadLettered.Load())
	}
	stop()

	// A new worker claims both partitions at their ends; this time
	// partition 0 ends with an aborted transaction and partition 1 with
	// a commit.
	p0.write(false, "x1", "x2")
	p1.write(true, "b1", "b2")
	want = append(want, "b1", "b2")
	w, stop = b.run(t, fn)
	defer stop()
	took = append(took, drained("restarted worker", want))
	p0.write(false, "x3")
	took = append(took, drained("an aborted tail while the restarted worker waits", want))
	if s := w.Stats(); s.Duplicates.Load() != 0 || s.DeadLettered.Load() != 0 {
		t.Errorf("restarted worker: %d duplicates, %d dead letters; want none", s.Duplicates.Load(), s.DeadLettered.Load())
	}
	// An idempotent replay from offset 0 takes the cursors back; the
	// worker skips every record again and ends past the markers.
	if _, err := operator.ReplayPartitions(context.Background(), b.pg.Pool, js, operator.ReplaySpec{
		Function: b.fn, Topic: b.topic, From: 0, LeaseBucket: b.cfg.LeaseBucket, KafkaBrokers: b.kafka.Brokers,
		ReplayOptions: inbox.ReplayOptions{Actor: "test"},
	}); err != nil {
		t.Fatalf("replay: %v", err)
	}
	took = append(took, drained("after an idempotent replay from offset 0", want))

	t.Logf("from the last record applied to every partition at its log end (cursor, status lag 0, group offset), by round: %v (BatchWait %s, offsets mirrored every second)",
		took, b.cfg.BatchWait)

	// kfn verify checks every committed record below the cursors, and
	// counts no marker or aborted record as lost.
	rep, err := verify.Run(context.Background(), b.pg.Pool, nil, verify.Spec{
		Function: b.fn, Topic: b.topic, KafkaBrokers: b.kafka.Brokers, Examples: 5, UnpublishedAfter: time.Minute,
	})
	if err != nil {
		t.Fatalf("verify: %v", err)
	}
	if !rep.OK || rep.Checked.Records != int64(len(want)) {
		t.Errorf("verify: ok %v, %d records checked (want %d), violations %+v", rep.OK, rep.Checked.Records, len(want), rep.Violations)
	}
}

// sorted returns a sorted copy of values.
func sorted(values []string) []string {
	out := slices.Clone(values)
	slices.Sort(out)
	return out
}
