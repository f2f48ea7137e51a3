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
)

// ledgerDebits is the ledger's effects query: one debit per booked event.
const ledgerDebits = `SELECT event_id FROM ledger_entries WHERE side = 'debit'`

// deployLedger runs the ledger's handler, over two lanes, on events
// orders.accepted events published to a subject of its own (the last one
// not a valid order: dead-lettered), until every event is handled.
func deployLedger(t *testing.T, events int) (*kfntest.PG, jetstream.JetStream, verify.Spec) {
	t.Helper()
	ctx := context.Background()
	db := kfntest.Postgres(t)
	natsURL := kfntest.NATSURL(t)
	js, stream, subject := eventSource(t)
	for i := range events {
		msg := nats.NewMsg(subject)
		id := fmt.Sprintf("o%d", i)
		msg.Header.Set(jetstream.MsgIDHeader, "ev-"+id)
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
	w, err := runtime.NewWorker(ctx, runtime.Config{
		KafkaBrokers: kfntest.Kafka(t).Brokers, DatabaseURL: db.URL, NATSURL: natsURL, WorkerID: "worker-1",
		LeaseBucket: kfntest.Name(t, "leases"), EventStream: kfntest.Name(t, "captured"), BatchWait: 5 * time.Millisecond, Lanes: 2,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})),
	}, fn)
	if err != nil {
		t.Fatal(err)
	}
	stop := kfntest.Background(t, "worker", w.Run)
	waitFor(t, "every event handled", func() bool {
		var n int
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.event_inbox WHERE consumer = $1`, fn.Name).Scan(&n)
		return err == nil && n == events
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
	if bad := only(rep, "", 0, ""); bad != "" || rep.Checked.Records != events || rep.Checked.Effects != events-dead || len(rep.Cut.Partitions) != 2 {
		t.Fatalf("clean run: %s; checked %+v, want %d events and %d effects; cut %+v", bad, rep.Checked, events, events-dead, rep.Cut)
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
