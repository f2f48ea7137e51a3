package verify_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/operator/verify"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

// deployment is a function that ran to the end over a topic: its effects
// (one row per record in effects, a count per key in counts), its dead
// letters, and its events relayed to the stream. The worker is stopped,
// so the tests change the state by hand and run the check on it.
type deployment struct {
	db      *kfntest.PG
	kafka   *kfntest.KafkaCluster
	topic   string
	subject string
	js      jetstream.JetStream
	stream  jetstream.Stream
	spec    verify.Spec
	// start starts a worker of the function again; stop stops it.
	start func() (stop func())
	lease string
}

const function = "vfn"

// perRecord and perKey are the function's effects queries in two shapes.
const (
	perRecord = `SELECT source_topic, source_partition, source_offset FROM effects`
	perKey    = `SELECT key, revisions FROM counts`
)

// deploy runs the function over records records spread over two
// partitions and five keys; the record with value "poison" is
// dead-lettered.
func deploy(t *testing.T, records int) *deployment {
	t.Helper()
	ctx := context.Background()
	d := &deployment{db: kfntest.Postgres(t), kafka: kfntest.Kafka(t)}
	d.topic = d.kafka.CreateTopic(t, 2)
	d.subject = kfntest.Name(t, "v") + ".done"
	streamName := kfntest.Name(t, "events")
	natsURL := kfntest.NATSURL(t)
	fn := runtime.Function{
		Name: function, Topic: d.topic, Emits: []string{d.subject},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `
CREATE TABLE IF NOT EXISTS effects (source_topic text, source_partition int, source_offset bigint);
CREATE TABLE IF NOT EXISTS counts (key text PRIMARY KEY, revisions int NOT NULL)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			if string(rec.Value) == "poison" {
				return runtime.Permanent(errors.New("poison"))
			}
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, $2, $3)`, rec.Topic, rec.Partition, rec.Offset); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO counts VALUES ($1, 1) ON CONFLICT (key) DO UPDATE SET revisions = counts.revisions + 1`, string(rec.Key)); err != nil {
				return err
			}
			out.Emit(runtime.Event{Subject: d.subject, Data: rec.Value})
			return nil
		},
	}
	msgs := make([]kafka.Message, records)
	for i := range msgs {
		msgs[i] = kafka.Message{Partition: i % 2, Key: []byte(fmt.Sprintf("k%d", i%5)), Value: []byte(fmt.Sprintf("v%d", i))}
	}
	msgs[len(msgs)/2].Value = []byte("poison")
	d.kafka.Produce(t, d.topic, msgs...)
	d.lease = kfntest.Name(t, "leases")
	d.start = func() func() {
		w, err := worker.New(ctx, runtime.Config{
			KafkaBrokers: d.kafka.Brokers, DatabaseURL: d.db.URL, NATSURL: natsURL, WorkerID: "worker-1",
			LeaseBucket: d.lease, EventStream: streamName, BatchWait: 5 * time.Millisecond,
			// A restarted worker takes its own partitions back at once
			// (same WorkerID); a 6 s TTL gives statements 2.4 s
			// (KFN_STATEMENT_TIMEOUT's default, 0.4 TTL), so a loaded
			// machine does not dead-letter the records the subtests
			// expect applied (0.8 s did, under load average 11-29).
			LeaseTTL: 6 * time.Second, LeaseRenew: time.Second,
			Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})),
		}, fn)
		if err != nil {
			t.Fatal(err)
		}
		return kfntest.Background(t, "worker", w.Run)
	}
	stop := d.start()
	nc, js, err := connect.NATS(natsURL, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	d.js = js
	waitFor(t, "every record handled and every event relayed", func() bool {
		var handled, outbox int
		if err := d.db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM kfn.inbox), (SELECT count(*) FROM kfn.outbox)`).Scan(&handled, &outbox); err != nil {
			return false
		}
		return handled == records && outbox == 0
	})
	stop()
	if d.stream, err = js.Stream(ctx, streamName); err != nil {
		t.Fatal(err)
	}
	d.spec = verify.Spec{
		Function: function, Topic: d.topic, EffectsSQL: perRecord, UnpublishedAfter: time.Minute, Examples: 3,
		KafkaBrokers: d.kafka.Brokers, Stream: streamName,
	}
	return d
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// check runs the check with spec and returns its report.
func (d *deployment) check(t *testing.T, spec verify.Spec) *verify.Report {
	t.Helper()
	rep, err := verify.Run(context.Background(), d.db.Pool, d.js, spec)
	if err != nil {
		t.Fatalf("verify: %v", err)
	}
	return rep
}

func (d *deployment) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	if _, err := d.db.Pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// republish publishes a copy of msg with id as its ce-id, no
// Nats-Msg-Id (JetStream's duplicate window would drop it) and the headers
// in set (name, value, …) changed, and returns its sequence.
func republish(t *testing.T, js jetstream.JetStream, msg *jetstream.RawStreamMsg, id string, set ...string) uint64 {
	t.Helper()
	h := nats.Header{}
	for k, v := range msg.Header {
		if k != jetstream.MsgIDHeader {
			h[k] = v
		}
	}
	h.Set(outbox.HeaderID, id)
	for i := 0; i+1 < len(set); i += 2 {
		h.Set(set[i], set[i+1])
	}
	ack, err := js.PublishMsg(context.Background(), &nats.Msg{Subject: msg.Subject, Header: h, Data: msg.Data})
	if err != nil {
		t.Fatal(err)
	}
	return ack.Sequence
}

// only says what is wrong with rep unless exactly the violations of kind
// were found, count of them, an example containing want (kind "": none).
func only(rep *verify.Report, kind string, count int64, want string) string {
	if kind == "" {
		return found(rep, nil, nil)
	}
	return found(rep, map[string]int64{kind: count}, map[string][]string{kind: {want}})
}

// found says what is wrong with rep unless its violations are exactly
// want (kind: count; the kinds left out: none), each example of a kind
// holding one of the texts in examples[kind], and every text there in one.
func found(rep *verify.Report, want map[string]int64, examples map[string][]string) string {
	all := map[string]verify.Violation{
		"lost": rep.Violations.Lost, "duplicated": rep.Violations.Duplicated, "unexpected": rep.Violations.Unexpected,
		"fenced_but_committed": rep.Violations.FencedButCommitted, "unpublished": rep.Violations.Unpublished, "out_of_order": rep.Violations.OutOfOrder,
	}
	var bad []string
	for kind, v := range all {
		if v.Count != want[kind] {
			bad = append(bad, fmt.Sprintf("%s: %d (%q), want %d", kind, v.Count, v.Examples, want[kind]))
			continue
		}
		got := strings.Join(v.Examples, "\n")
		for _, text := range examples[kind] {
			if !strings.Contains(got, text) {
				bad = append(bad, fmt.Sprintf("%s examples %q, want one holding %q", kind, v.Examples, text))
			}
		}
	}
	var total int64
	for _, n := range want {
		total += n
	}
	if rep.OK != (total == 0) {
		bad = append(bad, fmt.Sprintf("ok %v with %d violations", rep.OK, total))
	}
	return strings.Join(bad, "; ")
}

// A clean run is clean in every effects shape, and every injected
// violation is found with an example: each is injected into the
// deployment, checked and taken back before the next.
func TestVerifyFindsInjectedViolations(t *testing.T) {
	d := deploy(t, 40)
	ctx := context.Background()
	var dead int64 // the poison record, and any a loaded machine made time out
	if err := d.db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.dead_letters`).Scan(&dead); err != nil {
		t.Fatal(err)
	}
	rep := d.check(t, d.spec)
	if bad := only(rep, "", 0, ""); bad != "" || rep.Checked.Records != 40 || rep.Checked.Events != 40-dead || rep.Checked.Effects != 40-dead {
		t.Fatalf("clean run: %s; checked %+v, want 40 records, %d events and effects; cut %+v", bad, rep.Checked, 40-dead, rep.Cut)
	}
	for _, sql := range []string{perKey, `SELECT sum(revisions) FROM counts`, ""} {
		spec := d.spec
		spec.EffectsSQL = sql
		if bad := only(d.check(t, spec), "", 0, ""); bad != "" {
			t.Errorf("clean run with effects %q: %s", sql, bad)
		}
	}

	t.Run("an effect deleted is lost", func(t *testing.T) {
		d.exec(t, `DELETE FROM effects WHERE source_partition = 1 AND source_offset = 3`)
		defer d.exec(t, `INSERT INTO effects VALUES ($1, 1, 3)`, d.topic)
		if bad := only(d.check(t, d.spec), "lost", 1, "1@3 has no effect"); bad != "" {
			t.Error(bad)
		}
	})
	t.Run("a second effect is duplicated", func(t *testing.T) {
		d.exec(t, `INSERT INTO effects VALUES ($1, 0, 4)`, d.topic)
		defer d.exec(t, `DELETE FROM effects WHERE ctid = (SELECT max(ctid) FROM effects WHERE source_partition = 0 AND source_offset = 4)`)
		if bad := only(d.check(t, d.spec), "duplicated", 1, "0@4 has 2 effects"); bad != "" {
			t.Error(bad)
		}
	})
	t.Run("a re-executed record has one more effect", func(t *testing.T) {
		d.exec(t, `INSERT INTO kfn.audit_log (actor, action, consumer, topic, partition, details)
VALUES ('test', 'reexecute', $1, $2, 1, '{"from": 2, "to": 3, "previous_high_water": 20}')`, function, d.topic)
		defer d.exec(t, `DELETE FROM kfn.audit_log WHERE action = 'reexecute'`)
		var had int // 1, or 0 when a loaded machine dead-lettered the record
		if err := d.db.Pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE source_partition = 1 AND source_offset = 2`).Scan(&had); err != nil {
			t.Fatal(err)
		}
		d.exec(t, `INSERT INTO effects VALUES ($1, 1, 2)`, d.topic)
		defer d.exec(t, `DELETE FROM effects WHERE ctid IN (SELECT ctid FROM effects WHERE source_partition = 1 AND source_offset = 2 OFFSET $1)`, had)
		if bad := only(d.check(t, d.spec), "", 0, ""); bad != "" {
			t.Errorf("a second effect of a re-executed record: %s", bad)
		}
		d.exec(t, `INSERT INTO effects VALUES ($1, 1, 2)`, d.topic)
		if bad := only(d.check(t, d.spec), "duplicated", 1, "1@2 has 3 effects (re-executed 1 times)"); bad != "" {
			t.Error(bad)
		}
	})
	t.Run("a count too high per key is duplicated", func(t *testing.T) {
		d.exec(t, `UPDATE counts SET revisions = revisions + 1 WHERE key = 'k2'`)
		defer d.exec(t, `UPDATE counts SET revisions = revisions - 1 WHERE key = 'k2'`)
		spec := d.spec
		spec.EffectsSQL = perKey
		if bad := only(d.check(t, spec), "duplicated", 1, `key "k2": 1 effects more than applied records`); bad != "" {
			t.Error(bad)
		}
	})
	t.Run("an effect of no record is unexpected", func(t *testing.T) {
		d.exec(t, `INSERT INTO effects VALUES ($1, 1, 500)`, d.topic)
		defer d.exec(t, `DELETE FROM effects WHERE source_offset = 500`)
		if bad := only(d.check(t, d.spec), "unexpected", 1, "1@500 has 1 effects, at or above the cursor"); bad != "" {
			t.Error(bad)
		}
	})
	t.Run("a NATS-triggered function's effects are per event", func(t *testing.T) {
		d.exec(t, `INSERT INTO kfn.subject_lanes (consumer, subject, lanes, changed_at) VALUES ($1, $2, 1, now())`, function, d.topic)
		defer d.exec(t, `DELETE FROM kfn.subject_lanes`)
		_, err := verify.Run(ctx, d.db.Pool, d.js, d.spec)
		var bad *verify.SpecError
		if !errors.As(err, &bad) || bad.Flag != "effects-sql" || !strings.Contains(err.Error(), "(event_id) per applied event") {
			t.Errorf("verify of a NATS-triggered function with a per-record query: %v; want an --effects-sql error asking for (event_id)", err)
		}
	})
	t.Run("a parked key is stated in the cut", func(t *testing.T) {
		d.exec(t, `INSERT INTO kfn.parked_keys (consumer, topic, partition, record_key, blocking_offset) VALUES ($1, $2, 0, 'k0', 10)`, function, d.topic)
		defer d.exec(t, `DELETE FROM kfn.parked_keys`)
		rep := d.check(t, d.spec)
		if bad := only(rep, "", 0, ""); bad != "" || len(rep.Cut.Notes) != 1 || !strings.Contains(rep.Cut.Notes[0], "1 keys are parked") {
			t.Errorf("%s; notes %q, want one saying 1 key is parked", bad, rep.Cut.Notes)
		}
	})
	t.Run("an outbox row left behind is unpublished", func(t *testing.T) {
		d.exec(t, `INSERT INTO kfn.outbox (event_id, subject, event_type, event_key, shard, data, source, source_topic, source_partition, source_offset, created_at)
VALUES ('stuck-1', $1, $1, 'k1', 0, '', $2, $3, 0, 2, now() - interval '2 minutes')`, d.subject, function, d.topic)
		defer d.exec(t, `DELETE FROM kfn.outbox WHERE event_id = 'stuck-1'`)
		if bad := only(d.check(t, d.spec), "unpublished", 1, "event stuck-1 on "+d.subject+" for 0@2"); bad != "" {
			t.Error(bad)
		}
	})
	t.Run("events the WAL outbox slot holds unrelayed are unpublished", func(t *testing.T) {
		setup, err := outbox.SetUpWAL(ctx, d.db.Pool)
		if err != nil {
			t.Fatal(err)
		}
		defer d.exec(t, `SELECT pg_drop_replication_slot($1)`, setup.Slot)
		defer d.exec(t, `DELETE FROM kfn.wal_outbox`)
		// What a slot reader reports (kfn status shows it) while the
		// stream has acked none of 7 events read for 2 minutes.
		d.exec(t, `UPDATE kfn.wal_outbox SET pending_events = 7, oldest_pending = now() - interval '2 minutes', reported_at = now() - interval '1 second', reader = 'w-1'`)
		if bad := only(d.check(t, d.spec), "unpublished", 7, "7 events in the WAL outbox slot "+setup.Slot+" read and not acked by the stream"); bad != "" {
			t.Error(bad)
		}
		d.exec(t, `UPDATE kfn.wal_outbox SET oldest_pending = now() - interval '10 seconds'`)
		if bad := only(d.check(t, d.spec), "", 0, ""); bad != "" {
			t.Errorf("events pending for less than --unpublished-after: %s", bad)
		}
		d.exec(t, `SELECT pg_drop_replication_slot($1)`, setup.Slot)
		if bad := only(d.check(t, d.spec), "unpublished", 1, "the WAL outbox slot "+setup.Slot+" is lost"); bad != "" {
			t.Error(bad)
		}
		d.exec(t, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, setup.Slot)
	})

	// One event of partition 0, as the relay published it.
	first := func(t *testing.T, o int64) *jetstream.RawStreamMsg {
		t.Helper()
		info, err := d.stream.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
			msg, err := d.stream.GetMsg(ctx, seq)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				continue // deleted by an earlier case
			}
			if err != nil {
				t.Fatal(err)
			}
			if msg.Header.Get(outbox.HeaderSourcePartition) == "0" && msg.Header.Get(outbox.HeaderSourceOffset) == fmt.Sprint(o) {
				return msg
			}
		}
		t.Fatalf("no event for 0@%d in the stream", o)
		return nil
	}
	republish := func(t *testing.T, msg *jetstream.RawStreamMsg, id string) uint64 {
		t.Helper()
		return republish(t, d.js, msg, id)
	}
	deleteMsg := func(t *testing.T, seq uint64) {
		t.Helper()
		if err := d.stream.DeleteMsg(ctx, seq); err != nil {
			t.Fatal(err)
		}
	}
	t.Run("an event published again under a new id is duplicated", func(t *testing.T) {
		seq := republish(t, first(t, 6), "0f0f0f0f-0000-8000-8000-000000000001")
		defer deleteMsg(t, seq)
		if bad := only(d.check(t, d.spec), "duplicated", 1, "event 0f0f0f0f-0000-8000-8000-000000000001 on "+d.subject+fmt.Sprintf(` (stream seq %d, key "k2") is a second event for 0@6`, seq)); bad != "" {
			t.Error(bad)
		}
	})
	t.Run("an event stored twice is duplicated", func(t *testing.T) {
		msg := first(t, 8)
		seq := republish(t, msg, msg.Header.Get(outbox.HeaderID))
		defer deleteMsg(t, seq)
		if bad := only(d.check(t, d.spec), "duplicated", 1, "for 0@8 is in the stream again"); bad != "" {
			t.Error(bad)
		}
	})
	t.Run("two events of a key swapped are out of order", func(t *testing.T) {
		// Key k0 is on partition 0 at offsets 0, 5, 10 (the poison) and
		// 15: its last two events, for 0@5 and 0@15, are published again
		// in the opposite order, and the originals deleted.
		a, b := first(t, 5), first(t, 15)
		seqB := republish(t, b, b.Header.Get(outbox.HeaderID))
		seqA := republish(t, a, a.Header.Get(outbox.HeaderID))
		deleteMsg(t, a.Sequence)
		deleteMsg(t, b.Sequence)
		defer func() {
			deleteMsg(t, seqA)
			deleteMsg(t, seqB)
			republish(t, a, a.Header.Get(outbox.HeaderID))
			republish(t, b, b.Header.Get(outbox.HeaderID))
		}()
		if bad := only(d.check(t, d.spec), "out_of_order", 1, fmt.Sprintf(`(stream seq %d, key "k0") for 0@5 comes after the event for 0@15 (stream seq %d)`, seqA, seqB)); bad != "" {
			t.Error(bad)
		}
	})
	t.Run("a commit with a stale epoch is fenced_but_committed", func(t *testing.T) {
		// A new owner claims partition 0; the old one, not fenced, commits
		// the next record by hand with its epoch.
		part := inbox.Partition{Consumer: function, Topic: d.topic, Partition: 0}
		old, err := inbox.ReadCursor(ctx, d.db.Pool, part)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := inbox.ClaimPartition(ctx, d.db.Pool, part, old.Epoch+1, "worker-2", 0); err != nil {
			t.Fatal(err)
		}
		d.kafka.Produce(t, d.topic, kafka.Message{Partition: 0, Key: []byte("k9"), Value: []byte("late")})
		o := old.NextOffset
		d.exec(t, `INSERT INTO kfn.inbox (lane, "offset", epoch) SELECT id, $3, $4 FROM kfn.lanes WHERE consumer = $1 AND topic = $2 AND partition = 0`, function, d.topic, o, old.Epoch)
		d.exec(t, `INSERT INTO effects VALUES ($1, 0, $2)`, d.topic, o)
		d.exec(t, `UPDATE kfn.cursors SET next_offset = $3, high_water = $3 WHERE consumer = $1 AND topic = $2 AND partition = 0`, function, d.topic, o+1)
		if bad := only(d.check(t, d.spec), "fenced_but_committed", 1,
			fmt.Sprintf("0@%d was committed by epoch %d after epoch %d had claimed the partition from offset %d", o, old.Epoch, old.Epoch+1, o)); bad != "" {
			t.Error(bad)
		}
	})
}

// A re-execution applies records again on purpose: their second effects,
// their events under new ids and the epochs it leaves are no violation,
// in each effects shape.
func TestVerifyAcceptsAReexecution(t *testing.T) {
	d := deploy(t, 40)
	ctx := context.Background()
	stop := d.start()
	defer stop()
	_, err := operator.Replay(ctx, d.db.Pool, d.js, operator.ReplaySpec{
		Function: function, Topic: d.topic, Partitions: []int32{1}, From: 2, LeaseBucket: d.lease,
		ReplayOptions: inbox.ReplayOptions{To: 6, Reexecute: true, Reason: "test", Actor: "test"},
	})
	if err != nil {
		t.Fatal(err)
	}
	// While the worker applies them again, and after.
	shapes := []string{perRecord, perKey, `SELECT sum(revisions) FROM counts`, ""}
	for _, sql := range shapes {
		spec := d.spec
		spec.EffectsSQL = sql
		if bad := only(d.check(t, spec), "", 0, ""); bad != "" {
			t.Errorf("during a re-execution, effects %q: %s", sql, bad)
		}
	}
	waitFor(t, "the re-executed records handled and their events relayed", func() bool {
		var next, outbox int
		err := d.db.Pool.QueryRow(ctx, `SELECT (SELECT next_offset FROM kfn.cursors WHERE partition = 1), (SELECT count(*) FROM kfn.outbox)`).Scan(&next, &outbox)
		return err == nil && next == 20 && outbox == 0
	})
	for _, sql := range shapes {
		spec := d.spec
		spec.EffectsSQL = sql
		if bad := only(d.check(t, spec), "", 0, ""); bad != "" {
			t.Errorf("after a re-execution, effects %q: %s", sql, bad)
		}
	}
}

// Under load (records produced between the checks and the worker applying
// them all along), every check reads below its consistent cut and finds no
// violation.
func TestVerifyIsExactUnderLoad(t *testing.T) {
	d := deploy(t, 40)
	stop := d.start()
	defer stop()
	handled := func() int {
		var n int
		if d.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kfn.inbox`).Scan(&n) != nil {
			return -1
		}
		return n
	}
	var checked []int64
	for round := range 8 {
		if round == 1 {
			waitFor(t, "the worker to take the partitions again", func() bool { return handled() > 40 })
		}
		msgs := make([]kafka.Message, 50)
		for i := range msgs {
			msgs[i] = kafka.Message{Partition: i % 2, Key: []byte(fmt.Sprintf("k%d", i%5)), Value: []byte(fmt.Sprintf("more-%d-%d", round, i))}
		}
		d.kafka.Produce(t, d.topic, msgs...)
		rep := d.check(t, d.spec)
		if bad := only(rep, "", 0, ""); bad != "" {
			t.Errorf("under load: %s; cut %+v", bad, rep.Cut)
		}
		checked = append(checked, rep.Checked.Records)
	}
	waitFor(t, "the worker to apply every record", func() bool { return handled() == 40+8*50 })
	rep := d.check(t, d.spec)
	if bad := only(rep, "", 0, ""); bad != "" || rep.Checked.Records != 40+8*50 {
		t.Errorf("once the worker caught up: %s; %d records checked, want %d", bad, rep.Checked.Records, 40+8*50)
	}
	t.Logf("records checked per run %v, 50 more produced before each", checked)
}
