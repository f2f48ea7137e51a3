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

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/operator/verify"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// ledgerDebits is the ledger's effects query: one debit per booked event.
const ledgerDebits = `SELECT event_id FROM ledger_entries WHERE side = 'debit'`

// deployLedger runs the ledger's handler, over two lanes, on
// orders.accepted events published to a subject of its own (event ev-oI
// for order oI%10, keyed by it; the last one not a valid order:
// dead-lettered), until every event is handled. The ledger's
// payments.captured events go to the same stream, as they do in a
// deployment with one event stream.
func deployLedger(t *testing.T, events int) (*kfntest.PG, jetstream.JetStream, verify.Spec) {
	t.Helper()
	ctx := context.Background()
	db := kfntest.Postgres(t)
	natsURL := kfntest.NATSURL(t)
	js, stream, subject := eventSource(t)
	for i := range events {
		msg := nats.NewMsg(subject)
		id := fmt.Sprintf("o%d", i%10)
		msg.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("ev-o%d", i))
		msg.Header.Set("kfn-key", id)
		msg.Data = fmt.Appendf(nil, `{"order_id":%q,"customer":"c%d","amount_cents":%d,"currency":"EUR"}`, id, i%3, 100+i)
		if i == events-1 {
			msg.Data = []byte(`{"order_id":""}`)
		}
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	fn := runtime.Function{Name: "ledger-v", Subject: subject, Stream: stream, Emits: []string{ledger.CapturedSubject},
		BatchHandler: ledger.HandleBatch, Setup: ledger.Setup}
	w, err := worker.New(ctx, runtime.Config{
		KafkaBrokers: kfntest.Kafka(t).Brokers, DatabaseURL: db.URL, NATSURL: natsURL, WorkerID: "worker-1",
		LeaseBucket: kfntest.Name(t, "leases"), EventStream: stream, BatchWait: 5 * time.Millisecond, Lanes: 2,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})),
	}, fn)
	if err != nil {
		t.Fatal(err)
	}
	stop := kfntest.Background(t, "worker", w.Run)
	waitFor(t, "every event handled and its payments.captured event published", func() bool {
		var n, pending int
		err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM kfn.event_inbox WHERE consumer = $1), (SELECT count(*) FROM kfn.outbox)`, fn.Name).Scan(&n, &pending)
		return err == nil && n == events && pending == 0
	})
	stop()
	return db, js, verify.Spec{Function: fn.Name, Topic: subject, Stream: stream, EffectsSQL: ledgerDebits, UnpublishedAfter: time.Minute, Examples: 3}
}

// eventSource connects to the test NATS server and creates a stream
// holding one subject of the test's own.
func eventSource(tb testing.TB) (js jetstream.JetStream, stream, subject string) {
	tb.Helper()
	nc, js, err := connect.NATS(kfntest.NATSURL(tb), tb.Name())
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(nc.Close)
	stream, subject = kfntest.Name(tb, "source"), kfntest.Name(tb, "orders")+".accepted"
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: stream, Subjects: []string{subject}}); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { // a worker added payments.captured to it, which no other stream may then hold
		if err := js.DeleteStream(context.Background(), stream); err != nil {
			tb.Errorf("delete stream %s: %v", stream, err)
		}
	})
	return js, stream, subject
}

// The ledger, a NATS-triggered function, is checked against the events
// on its subject: clean in every effects shape, and a lost, a duplicated
// and an unexpected booking are each found with the event's id, and a
// booking by a fenced owner with its epoch.
func TestVerifyChecksANATSTriggeredFunction(t *testing.T) {
	const events = 30
	db, js, spec := deployLedger(t, events)
	ctx := context.Background()
	run := func(spec verify.Spec) *verify.Report {
		t.Helper()
		rep, err := verify.Run(ctx, db.Pool, js, spec)
		if err != nil {
			t.Fatalf("verify: %v", err)
		}
		return rep
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	var dead int64 // the invalid order, and any a loaded machine made time out
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.event_inbox WHERE outcome = 'dead_lettered'`).Scan(&dead); err != nil {
		t.Fatal(err)
	}
	rep := run(spec)
	var table strings.Builder
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	t.Logf("clean run:\n%s", table.String())
	if bad := only(rep, "", 0, ""); bad != "" || rep.Checked.Records != events || rep.Checked.Effects != events-dead || rep.Checked.Events != events-dead || len(rep.Cut.Partitions) != 2 {
		t.Fatalf("clean run: %s; checked %+v, want %d events on the subject, %d effects and as many payments.captured events; cut %+v", bad, rep.Checked, events, events-dead, rep.Cut)
	}
	for _, sql := range []string{`SELECT order_id, count(*) FROM ledger_entries WHERE side = 'debit' GROUP BY order_id`,
		`SELECT count(*) FROM ledger_entries WHERE side = 'debit'`, ""} {
		s := spec
		s.EffectsSQL = sql
		if bad := only(run(s), "", 0, ""); bad != "" {
			t.Errorf("clean run with %q: %s", sql, bad)
		}
	}

	// Lost: the debit of ev-o3 turned into a credit.
	var id int64
	if err := db.Pool.QueryRow(ctx, `UPDATE ledger_entries SET side = 'credit' WHERE event_id = 'ev-o3' AND side = 'debit' RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if bad := only(run(spec), "lost", 1, "event ev-o3 (stream seq 4"); bad != "" {
		t.Errorf("a lost booking: %s", bad)
	}
	exec(`UPDATE ledger_entries SET side = 'debit' WHERE id = $1`, id)

	// Duplicated: ev-o4 booked twice.
	if err := db.Pool.QueryRow(ctx, `INSERT INTO ledger_entries (account, side, amount_cents, currency, order_id, event_id)
SELECT account, side, amount_cents, currency, order_id, event_id FROM ledger_entries WHERE event_id = 'ev-o4' AND side = 'debit' RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if bad := only(run(spec), "duplicated", 1, "event ev-o4 (stream seq 5, lane "); bad != "" {
		t.Errorf("a second booking: %s", bad)
	}
	exec(`DELETE FROM ledger_entries WHERE id = $1`, id)

	// Unexpected: a booking for an event the stream never held.
	exec(`INSERT INTO ledger_entries (account, side, amount_cents, currency, order_id, event_id) VALUES ('receivable:x', 'debit', 1, 'EUR', 'x', 'ev-nowhere')`)
	if bad := only(run(spec), "unexpected", 1, "event ev-nowhere has 1 effects, but stream "+spec.Stream+" has no such event"); bad != "" {
		t.Errorf("a booking of no event: %s", bad)
	}
	exec(`DELETE FROM ledger_entries WHERE event_id = 'ev-nowhere'`)
	if bad := only(run(spec), "", 0, ""); bad != "" {
		t.Errorf("after taking every injection back: %s", bad)
	}

	// The ledger's own payments.captured events: each is found by the
	// order event it was emitted for (its kfn-source-offset, a stream
	// sequence on the subject), and checked like a Kafka-triggered
	// function's events.
	stream, err := js.Stream(ctx, spec.Stream)
	if err != nil {
		t.Fatal(err)
	}
	captured := func(source uint64) *jetstream.RawStreamMsg {
		t.Helper()
		info, err := stream.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
			msg, err := stream.GetMsg(ctx, seq)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				continue // deleted by an earlier case
			}
			if err != nil {
				t.Fatal(err)
			}
			if msg.Subject == ledger.CapturedSubject && msg.Header.Get(outbox.HeaderSourceOffset) == fmt.Sprint(source) {
				return msg
			}
		}
		t.Fatalf("no payments.captured event for the event at stream seq %d", source)
		return nil
	}
	republish := func(msg *jetstream.RawStreamMsg, id string, set ...string) uint64 {
		t.Helper()
		return republish(t, js, msg, id, set...)
	}
	deleteMsg := func(seq uint64) {
		t.Helper()
		if err := stream.DeleteMsg(ctx, seq); err != nil {
			t.Fatal(err)
		}
	}
	// ev-oI is at stream seq I+1, for order oI%10, in lane laneOf(oI%10).
	laneOf := func(i int) int { return outbox.LaneOf(fmt.Appendf(nil, "o%d", i%10), 2) }

	// Out of order: order o0's events are ev-o0, ev-o10 and ev-o20 (seq 1,
	// 11 and 21); the captured events of the last two are published again
	// in the opposite order, and the originals deleted.
	a, b := captured(11), captured(21)
	seqB := republish(b, b.Header.Get(outbox.HeaderID))
	seqA := republish(a, a.Header.Get(outbox.HeaderID))
	deleteMsg(a.Sequence)
	deleteMsg(b.Sequence)
	if bad := only(run(spec), "out_of_order", 1, fmt.Sprintf(`(stream seq %d, key "o0") for the event at stream seq 11 (lane %d) comes after the event for the event at stream seq 21 (lane %d) (stream seq %d)`,
		seqA, laneOf(0), laneOf(0), seqB)); bad != "" {
		t.Errorf("two captured events of an order swapped: %s", bad)
	}
	deleteMsg(seqA)
	deleteMsg(seqB)
	republish(a, a.Header.Get(outbox.HeaderID))
	republish(b, b.Header.Get(outbox.HeaderID))

	// Duplicated: the captured event of ev-o6 published again under a new
	// id, then that of ev-o8 stored twice.
	seq := republish(captured(7), "0f0f0f0f-0000-8000-8000-000000000001")
	if bad := only(run(spec), "duplicated", 1, fmt.Sprintf(`event 0f0f0f0f-0000-8000-8000-000000000001 on %s (stream seq %d, key "o6") is a second event for event ev-o6 (stream seq 7, lane %d)`,
		ledger.CapturedSubject, seq, laneOf(6))); bad != "" {
		t.Errorf("a captured event under a new id: %s", bad)
	}
	deleteMsg(seq)
	again := captured(9)
	seq = republish(again, again.Header.Get(outbox.HeaderID))
	if bad := only(run(spec), "duplicated", 1, fmt.Sprintf("for event ev-o8 (stream seq 9, lane %d) is in the stream again (first at seq %d)", laneOf(8), again.Sequence)); bad != "" {
		t.Errorf("a captured event stored twice: %s", bad)
	}
	deleteMsg(seq)

	// Unexpected: a captured event claiming as its source a stream
	// sequence that holds no event on the subject (a captured event's own),
	// and one for the dead-lettered ev-o29.
	seq = republish(captured(2), "0f0f0f0f-0000-8000-8000-000000000002", outbox.HeaderSourceOffset, fmt.Sprint(a.Sequence))
	if bad := only(run(spec), "unexpected", 1, fmt.Sprintf("claims to be for the event at stream seq %d, but there is no event on %s there", a.Sequence, spec.Topic)); bad != "" {
		t.Errorf("a captured event of no order event: %s", bad)
	}
	deleteMsg(seq)
	seq = republish(captured(2), outbox.EventID(spec.Function, outbox.SourceID("", 0, 0, "ev-o29", 0), 0), outbox.HeaderSourceOffset, "30", outbox.HeaderKey, "o9")
	if bad := only(run(spec), "unexpected", 1, fmt.Sprintf("for event ev-o29 (stream seq 30, lane %d), which was dead-lettered", laneOf(9))); bad != "" {
		t.Errorf("a captured event of a dead-lettered order event: %s", bad)
	}
	deleteMsg(seq)
	if bad := only(run(spec), "", 0, ""); bad != "" {
		t.Errorf("after taking every captured event injection back: %s", bad)
	}

	// Fenced but committed: a new owner claims lane 0; the old one, not
	// fenced, books the next event of the lane by hand with its epoch.
	part := inbox.Partition{Consumer: spec.Function, Topic: spec.Topic, Partition: 0}
	old, err := inbox.ReadCursor(ctx, db.Pool, part)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, old.Epoch+1, "worker-2", 0); err != nil {
		t.Fatal(err)
	}
	key := "late"
	for outbox.LaneOf([]byte(key), 2) != 0 {
		key += "+"
	}
	msg := nats.NewMsg(spec.Topic)
	msg.Header.Set(jetstream.MsgIDHeader, "ev-late")
	msg.Header.Set("kfn-key", key)
	ack, err := js.PublishMsg(ctx, msg)
	if err != nil {
		t.Fatal(err)
	}
	exec(`INSERT INTO kfn.event_inbox (consumer, event_id, subject, stream_seq, epoch) VALUES ($1, 'ev-late', $2, $3, $4)`, spec.Function, spec.Topic, ack.Sequence, old.Epoch)
	exec(`INSERT INTO ledger_entries (account, side, amount_cents, currency, order_id, event_id) VALUES ('receivable:x', 'debit', 1, 'EUR', $1, 'ev-late')`, key)
	exec(`UPDATE kfn.cursors SET next_offset = $3, high_water = $3 WHERE consumer = $1 AND topic = $2 AND partition = 0`, spec.Function, spec.Topic, ack.Sequence+1)
	if bad := only(run(spec), "fenced_but_committed", 1,
		fmt.Sprintf("0@%d was committed by epoch %d after epoch %d had claimed the partition from offset %d", ack.Sequence, old.Epoch, old.Epoch+1, old.NextOffset)); bad != "" {
		t.Errorf("a booking by a fenced owner: %s", bad)
	}

	// Without NATS the events cannot be read: the flag to give is named.
	var specErr *verify.SpecError
	if _, err := verify.Run(ctx, db.Pool, nil, spec); !errors.As(err, &specErr) || specErr.Flag != "nats-url" {
		t.Errorf("a NATS-triggered function without NATS: %v, want a SpecError naming --nats-url", err)
	}
}
