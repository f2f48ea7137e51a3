package runtime_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// txProducer writes to partition 0 of b's topic inside Kafka transactions,
// as Kafka Streams or Flink's exactly-once sinks do.
type txProducer struct {
	t  *testing.T
	cl *kgo.Client
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
		if err := p.cl.ProduceSync(ctx, &kgo.Record{Partition: 0, Value: []byte(v)}).FirstErr(); err != nil {
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
	log, err := engine.OpenKafkaLog(b.kafka.Brokers, kafkaconn.Security{})
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
		rec, err := engine.ReadRecord(ctx, b.kafka.Brokers, kafkaconn.Security{}, b.topic, 0, o)
		if i := slices.Index(offsets, o); i >= 0 {
			if err != nil || string(rec.Value) != want[i] {
				t.Errorf("the record at offset %d: %q, %v; want %s", o, rec.Value, err, want[i])
			}
		} else if err == nil || !strings.Contains(err.Error(), "no committed record") {
			t.Errorf("reading offset %d, a marker or a record of an aborted transaction: got %q, err = %v; want an error that says it holds no committed record", o, rec.Value, err)
		}
	}
}
