package verify_test

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/operator/verify"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// seeded is a function's state written straight into Kafka and Postgres,
// as if it had applied n records: n records over 4 partitions in Kafka
// (keys k0…k999), and in Postgres the cursors at the high watermarks, one
// claim per partition, and an inbox row and an effect row per record,
// with the counts per key.
type seeded struct {
	db    *kfntest.PG
	topic string
	spec  verify.Spec
}

func seed(tb testing.TB, n int) *seeded {
	tb.Helper()
	ctx := context.Background()
	const parts = 4
	s := &seeded{db: kfntest.Postgres(tb)}
	k := kfntest.Kafka(tb)
	s.topic = k.CreateTopic(tb, parts)
	transport := &kafka.Transport{} // its own metadata cache: the shared default one may not know the new topic yet
	defer transport.CloseIdleConnections()
	w := &kafka.Writer{
		Addr: kafka.TCP(k.Brokers...), Topic: s.topic, RequiredAcks: kafka.RequireOne, Transport: transport,
		Balancer:  kafka.BalancerFunc(func(m kafka.Message, _ ...int) int { return m.Partition }),
		BatchSize: 10000, BatchBytes: 16 << 20, BatchTimeout: time.Millisecond,
	}
	defer w.Close()
	batch := make([]kafka.Message, 0, 10000)
	for i := range n {
		batch = append(batch, kafka.Message{Partition: i % parts, Key: fmt.Appendf(nil, "k%d", i%1000), Value: []byte("v")})
		if len(batch) == cap(batch) || i == n-1 {
			if err := w.WriteMessages(ctx, batch...); err != nil {
				tb.Fatal(err)
			}
			batch = batch[:0]
		}
	}
	for _, sql := range []string{ // each takes the topic ($1) and n ($2)
		`INSERT INTO kfn.cursors (consumer, topic, partition, next_offset, high_water, epoch, owner)
 SELECT 'big', $1, p, ($2 - p + 3) / 4, ($2 - p + 3) / 4, 1, 'seed' FROM generate_series(0, 3) AS p`,
		`INSERT INTO kfn.audit_log (actor, action, consumer, topic, partition, details)
 SELECT 'seed', 'claim', 'big', $1, p, '{"epoch": 1, "next_offset": 0, "high_water": 0}' FROM generate_series(0, 3) AS p WHERE $2::int > 0`,
		`INSERT INTO kfn.lanes (consumer, topic, partition) SELECT 'big', $1, p FROM generate_series(0, 3) AS p WHERE $2::int >= 0`,
		`INSERT INTO kfn.inbox (lane, "offset", epoch) SELECT l.id, i / 4, 1 FROM generate_series(0, $2 - 1) AS i JOIN kfn.lanes l ON l.consumer = 'big' AND l.topic = $1 AND l.partition = i % 4`,
		`CREATE TABLE effects AS SELECT $1::text AS source_topic, i % 4 AS source_partition, (i / 4)::bigint AS source_offset FROM generate_series(0, $2 - 1) AS i`,
		`CREATE TABLE counts AS SELECT 'k' || i % 1000 AS key, count(*) AS revisions FROM generate_series(0, $2 - 1) AS i WHERE $1::text <> '' GROUP BY 1`,
	} {
		if _, err := s.db.Pool.Exec(ctx, sql, s.topic, n); err != nil {
			tb.Fatalf("%s: %v", sql, err)
		}
	}
	if _, err := s.db.Pool.Exec(ctx, `VACUUM ANALYZE`); err != nil {
		tb.Fatal(err)
	}
	s.spec = verify.Spec{Function: "big", Topic: s.topic, EffectsSQL: perRecord, UnpublishedAfter: time.Minute, Examples: 3, KafkaBrokers: k.Brokers}
	return s
}

func (s *seeded) run(tb testing.TB, effectsSQL string) *verify.Report {
	tb.Helper()
	spec := s.spec
	spec.EffectsSQL = effectsSQL
	rep, err := verify.Run(context.Background(), s.db.Pool, nil, spec)
	if err != nil {
		tb.Fatal(err)
	}
	return rep
}

// A range of 20,000 records is checked in each shape, reading every record
// from Kafka, with no violation (the CI-sized version of
// BenchmarkVerifyMillionRecords).
func TestVerifyChecksASeededRange(t *testing.T) {
	const n = 20000
	s := seed(t, n)
	for _, sql := range []string{perRecord, perKey, `SELECT count(*) FROM effects`, ""} {
		rep := s.run(t, sql)
		if !rep.OK || rep.Checked.Records != n {
			t.Errorf("effects %q: ok %v, checked %+v, violations %+v; want %d records, no violation", sql, rep.OK, rep.Checked, rep.Violations, n)
		}
		t.Logf("effects %q: %d records in %.2fs", sql, rep.Checked.Records, rep.Seconds)
	}
}

// BenchmarkVerifyMillionRecords checks 1,000,000 records (read from Kafka,
// keys and all) against their inbox rows and their effects: one row per
// record (sorted by Postgres, then again with an index on the effects
// table that spares the sort) and counts per key. The figures are in
// testdata/verify-bench.txt. Run it with
//
//	go test -run '^$' -bench BenchmarkVerifyMillionRecords -benchtime 2x ./operator/verify
func BenchmarkVerifyMillionRecords(b *testing.B) {
	const n = 1_000_000
	s := seed(b, n)
	for _, shape := range []struct {
		name, sql string
		before    []string
	}{
		{"per-record", perRecord, nil},
		{"per-key", perKey, nil},
		{"per-record-indexed", perRecord, []string{`CREATE INDEX ON effects (source_topic, source_partition, source_offset)`, `VACUUM ANALYZE effects`}},
	} {
		for _, sql := range shape.before {
			if _, err := s.db.Pool.Exec(context.Background(), sql); err != nil {
				b.Fatal(err)
			}
		}
		b.Run(shape.name, func(b *testing.B) {
			for b.Loop() {
				rep := s.run(b, shape.sql)
				if !rep.OK || rep.Checked.Records != n {
					b.Fatalf("ok %v, checked %+v, violations %+v", rep.OK, rep.Checked, rep.Violations)
				}
				b.Logf("%d records checked in %.2fs (%.0f records/s)", rep.Checked.Records, rep.Seconds, float64(n)/rep.Seconds)
			}
		})
	}
}

// seedEvents writes a NATS-triggered function's state straight into
// JetStream and Postgres, as if it had applied n events of one lane (ids
// e0…, keys k0…k999): the events on a subject of their own, the lane's
// cursor past the last, one claim, an event inbox row and a debit each.
func seedEvents(tb testing.TB, n int) (*kfntest.PG, jetstream.JetStream, verify.Spec) {
	tb.Helper()
	ctx := context.Background()
	db := kfntest.Postgres(tb)
	js, stream, subject := eventSource(tb)
	for i := range n {
		msg := nats.NewMsg(subject)
		msg.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("e%d", i))
		msg.Header.Set("kfn-key", fmt.Sprintf("k%d", i%1000))
		if _, err := js.PublishMsgAsync(msg); err != nil {
			tb.Fatal(err)
		}
		if i%1000 == 999 || i == n-1 { // a bounded window of acks outstanding
			select {
			case <-js.PublishAsyncComplete():
			case <-time.After(time.Minute):
				tb.Fatal("publishing the seeded events stalled for a minute")
			}
		}
	}
	for _, sql := range []string{ // each takes the subject ($1) and n ($2)
		`INSERT INTO kfn.subject_lanes (consumer, subject, lanes, changed_at) SELECT 'big', $1, 1, 'epoch' WHERE $2::int > 0`,
		`INSERT INTO kfn.cursors (consumer, topic, partition, next_offset, high_water, epoch, owner) VALUES ('big', $1, 0, $2 + 1, $2 + 1, 1, 'seed')`,
		`INSERT INTO kfn.audit_log (actor, action, consumer, topic, partition, details) SELECT 'seed', 'claim', 'big', $1, 0, '{"epoch": 1, "next_offset": 0, "high_water": 0}' WHERE $2::int > 0`,
		`INSERT INTO kfn.event_inbox (consumer, event_id, subject, stream_seq, epoch) SELECT 'big', 'e' || i, $1, i + 1, 1 FROM generate_series(0, $2 - 1) AS i`,
		`CREATE TABLE debits AS SELECT 'e' || i AS event_id FROM generate_series(0, $2 - 1) AS i WHERE $1::text <> ''`,
	} {
		if _, err := db.Pool.Exec(ctx, sql, subject, n); err != nil {
			tb.Fatalf("%s: %v", sql, err)
		}
	}
	if _, err := db.Pool.Exec(ctx, `VACUUM ANALYZE`); err != nil {
		tb.Fatal(err)
	}
	return db, js, verify.Spec{Function: "big", Topic: subject, Stream: stream, EffectsSQL: `SELECT event_id FROM debits`, UnpublishedAfter: time.Minute, Examples: 3}
}

// A range of 20,000 events of a NATS-triggered function is checked with
// no violation (the CI-sized version of BenchmarkVerifyEvents).
func TestVerifyChecksASeededEventRange(t *testing.T) {
	const n = 20000
	db, js, spec := seedEvents(t, n)
	rep, err := verify.Run(context.Background(), db.Pool, js, spec)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK || rep.Checked.Records != n || rep.Checked.Effects != n {
		t.Errorf("ok %v, checked %+v, violations %+v; want %d events and effects, no violation", rep.OK, rep.Checked, rep.Violations, n)
	}
	t.Logf("%d events in %.2fs", rep.Checked.Records, rep.Seconds)
}

// BenchmarkVerifyEvents checks 1,000,000 events of a NATS-triggered
// function (read from the stream) against their event inbox rows and one
// effect row each. The figures are in testdata/verify-bench.txt. Run it
// with
//
//	go test -run '^$' -bench BenchmarkVerifyEvents -benchtime 2x ./operator/verify
func BenchmarkVerifyEvents(b *testing.B) {
	const n = 1_000_000
	db, js, spec := seedEvents(b, n)
	for b.Loop() {
		cpu := cpuTime(b)
		rep, err := verify.Run(context.Background(), db.Pool, js, spec)
		cpu = cpuTime(b) - cpu
		if err != nil {
			b.Fatal(err)
		}
		if !rep.OK || rep.Checked.Records != n {
			b.Fatalf("ok %v, checked %+v, violations %+v", rep.OK, rep.Checked, rep.Violations)
		}
		b.Logf("%d events checked in %.2fs (%.0f events/s), %.2fs of CPU in the test process (the check and the embedded NATS server)",
			rep.Checked.Records, rep.Seconds, float64(n)/rep.Seconds, cpu.Seconds())
	}
}

// cpuTime is the CPU time (user and system) the test process has used.
func cpuTime(tb testing.TB) time.Duration {
	tb.Helper()
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
