package runtime_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestOutboxDataErrorIsChargedToTheRecord makes Postgres refuse one
// record's outbox row with a data error (a CHECK constraint on kfn.outbox,
// standing in for any content Postgres refuses) inside a batch of ten. The
// batch cannot say which record broke the COPY, so it goes on record by
// record: the culprit is retried alone and dead-lettered as data_error, the
// other nine commit, and the lane never retries anything as an
// infrastructure error.
func TestOutboxDataErrorIsChargedToTheRecord(t *testing.T) {
	b := setup(t, 1)
	b.cfg.NoRelay = true
	execSQL(t, b, `ALTER TABLE kfn.outbox ADD CONSTRAINT no_poison CHECK (position('\xdeadbeef'::bytea in data) = 0)`)
	values := make([][]byte, 10)
	for i := range values {
		values[i] = []byte(fmt.Sprintf("ok-%d", i))
	}
	values[6] = []byte("\xde\xad\xbe\xef")
	produced := b.produce(t, 0, values...)

	w, stop := b.run(t, effects.Function(b.fn, b.topic))
	b.waitCaughtUp(t, b.fn)
	stop()

	rep := b.check(t, b.fn, produced, produced[6])
	if rep.Applied != 9 || rep.DeadLetters != 1 {
		t.Errorf("applied=%d dead-lettered=%d, want 9 and 1", rep.Applied, rep.DeadLetters)
	}
	dead, err := inbox.ListDeadLetters(context.Background(), b.pg.Pool, b.fn, 10)
	if err != nil || len(dead) != 1 {
		t.Fatalf("dead letters = %+v, %v", dead, err)
	}
	if d := dead[0]; d.Offset != 6 || d.Reason != "data_error" || d.Attempts != b.cfg.RetryAttempts || !strings.Contains(d.Error, "no_poison") {
		t.Errorf("dead letter = offset %d reason %q attempts %d error %q; want offset 6, data_error after %d attempts, naming the constraint",
			d.Offset, d.Reason, d.Attempts, d.Error, b.cfg.RetryAttempts)
	}
	var outboxRows int
	if err := b.pg.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kfn.outbox`).Scan(&outboxRows); err != nil || outboxRows != 9 {
		t.Errorf("outbox rows = %d (%v), want 9", outboxRows, err)
	}
	if n := w.Stats().InfraRetries.Load(); n != 0 {
		t.Errorf("infrastructure retries = %d, want 0: a record's data error is not an outage", n)
	}
}

// TestDeadLetterRefusedByPostgresIsStoredRaw: when Postgres refuses even the
// dead letter row (here a CHECK constraint on its value), the record is
// parked as a raw blob with its reason and the partition moves on.
func TestDeadLetterRefusedByPostgresIsStoredRaw(t *testing.T) {
	b := setup(t, 1)
	execSQL(t, b, `ALTER TABLE kfn.dead_letters ADD CONSTRAINT no_permanent CHECK (value IS NULL OR value <> 'permanent'::bytea)`)
	headers := []kafka.Header{{Key: "h\x00\xff", Value: []byte{0, 1, 0xfe}}, {Key: "h\x00\xff", Value: nil}}
	b.kafka.Produce(t, b.topic,
		kafka.Message{Key: []byte("k0"), Value: []byte("ok-0")},
		kafka.Message{Key: []byte("\x00\x00\x00\x00\x01"), Value: []byte("permanent"), Headers: headers},
		kafka.Message{Key: []byte("k2"), Value: []byte("ok-2")},
	)
	w, stop := b.run(t, effects.Function(b.fn, b.topic))
	b.waitCaughtUp(t, b.fn)
	stop()

	rep := b.check(t, b.fn, []effects.Produced{{Offset: 0}, {Offset: 1}, {Offset: 2}}, effects.Produced{Offset: 1})
	if rep.Applied != 2 || rep.DeadLetters != 1 {
		t.Errorf("applied=%d dead-lettered=%d, want 2 and 1", rep.Applied, rep.DeadLetters)
	}
	var rawLen int
	var keyIsNull bool
	err := b.pg.Pool.QueryRow(context.Background(), `SELECT length(raw), record_key IS NULL FROM kfn.dead_letters WHERE consumer = $1`, b.fn).Scan(&rawLen, &keyIsNull)
	if err != nil || rawLen == 0 || !keyIsNull {
		t.Fatalf("dead letter row: raw %d bytes, key null %v (%v); want a raw blob only", rawLen, keyIsNull, err)
	}
	dead, err := inbox.ListDeadLetters(context.Background(), b.pg.Pool, b.fn, 10)
	if err != nil || len(dead) != 1 {
		t.Fatalf("dead letters = %+v, %v", dead, err)
	}
	d := dead[0]
	if !d.StoredRaw || d.Reason != "permanent" || !bytes.Equal(d.Key, []byte("\x00\x00\x00\x00\x01")) || string(d.Value) != "permanent" || len(d.Headers) != 2 ||
		string(d.Headers[0].Key) != "h\x00\xff" || !bytes.Equal(d.Headers[0].Value, []byte{0, 1, 0xfe}) || len(d.Headers[1].Value) != 0 {
		t.Errorf("dead letter = %+v; want the raw record with reason permanent", d)
	}
	if n := w.Stats().InfraRetries.Load(); n != 0 {
		t.Errorf("infrastructure retries = %d, want 0", n)
	}
}

// TestTraceContextIsValidatedBeforeTheOutbox: a valid traceparent and
// tracestate reach the emitted event's headers; invalid ones (NUL, invalid
// UTF-8, a malformed value) are dropped and counted, and the record is
// applied all the same.
func TestTraceContextIsValidatedBeforeTheOutbox(t *testing.T) {
	b := setup(t, 1)
	b.cfg.NoRelay = true
	const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	msgs := []kafka.Message{
		{Value: []byte("valid"), Headers: []kafka.Header{{Key: "traceparent", Value: []byte(parent)}, {Key: "tracestate", Value: []byte("rojo=00f067aa0ba902b7")}}},
		{Value: []byte("nul"), Headers: []kafka.Header{{Key: "traceparent", Value: []byte("00-\x00" + parent[4:])}}},
		{Value: []byte("utf8"), Headers: []kafka.Header{{Key: "traceparent", Value: []byte(parent[:10] + "\xff" + parent[11:])}}},
		{Value: []byte("bad-state"), Headers: []kafka.Header{{Key: "traceparent", Value: []byte(parent)}, {Key: "tracestate", Value: []byte("rojo=\x00")}}},
		{Value: []byte("two-parents"), Headers: []kafka.Header{{Key: "traceparent", Value: []byte(parent)}, {Key: "traceparent", Value: []byte(strings.Replace(parent, "4b", "5b", 1))}}},
		{Value: []byte("none")},
	}
	b.kafka.Produce(t, b.topic, msgs...)
	w, stop := b.run(t, effects.Function(b.fn, b.topic))
	b.waitCaughtUp(t, b.fn)
	stop() // the counters move after the commit the cursor shows: let them settle

	want := map[int64]map[string]string{
		0: {"traceparent": parent, "tracestate": "rojo=00f067aa0ba902b7"},
		1: {}, 2: {},
		3: {"traceparent": parent},
		4: {}, 5: {},
	}
	got := b.outboxHeaders(t, len(want))
	for off, h := range got {
		if fmt.Sprint(h) != fmt.Sprint(want[off]) {
			t.Errorf("offset %d: event headers %v, want %v", off, h, want[off])
		}
	}
	if n := w.Stats().TraceContextDropped.Load(); n != 4 {
		t.Errorf("trace context dropped = %d, want 4", n)
	}
	srv := httptest.NewServer(w.HTTPHandler())
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !bytes.Contains(body, []byte("kfn_trace_context_dropped_total{")) || !bytes.Contains(body, []byte("kfn_batch_infra_retries_total{")) {
		t.Errorf("metrics lack kfn_trace_context_dropped_total or kfn_batch_infra_retries_total")
	}
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "kfn_trace_context_dropped_total{") && !strings.HasSuffix(line, " 4") {
			t.Errorf("metric line %q, want 4", line)
		}
	}
}

// TestNATSEventsWithBinaryIDsAndKeys feeds a NATS-triggered function events
// whose Nats-Msg-Id holds NUL or invalid UTF-8 and whose key is binary
// (kfn-key-b64). They must be applied once each (a redelivery is skipped),
// keep their key bytes, and a failing one is dead-lettered with its header
// bytes; nothing is retried as an infrastructure error.
func TestNATSEventsWithBinaryIDsAndKeys(t *testing.T) {
	b := setup(t, 1)
	b.cfg.NoRelay = true
	ctx := context.Background()
	js := jetStream(t, b.cfg.NATSURL)
	stream, subject := kfntest.Name(t, "stream"), kfntest.Name(t, "subj")+".created"
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}, Duplicates: 100 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	binKey := []byte("\x00\x00\x00\x00\x2a\xff")
	ids := []string{"id-\x00-1", "id-\xff-2", "plain-3", "id-\x00-1"} // the last one is a republication of the first
	for i, id := range ids {
		msg := nats.NewMsg(subject)
		msg.Header.Set("Nats-Msg-Id", id)
		msg.Header.Set("kfn-key-b64", base64.StdEncoding.EncodeToString(binKey))
		msg.Header.Set("x-odd", "v\x00\xfe")
		msg.Data = []byte("ok")
		if i == 2 {
			msg.Data = []byte("permanent")
		}
		if i == 3 {
			time.Sleep(300 * time.Millisecond) // past the duplicate window: stored again
		}
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatalf("publish %q: %v", id, err)
		}
	}
	table := pgx.Identifier{"events_" + b.fn}.Sanitize()
	emits := "bytes." + b.fn
	fn := runtime.Function{
		Name: b.fn, Subject: subject, Stream: stream, Emits: []string{emits},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` (event_id text, key bytea)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			if string(rec.Value) == "permanent" {
				return runtime.Permanent(errors.New("bad event"))
			}
			out.Emit(runtime.Event{Subject: emits, Data: rec.Value})
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1, $2)`, rec.EventID, rec.Key)
			return err
		},
	}
	w, stop := b.run(t, fn)
	waitFor(t, 30*time.Second, "every event handled", func() bool {
		cons, err := js.Consumer(ctx, stream, b.fn)
		if err != nil {
			return false
		}
		ci, err := cons.Info(ctx)
		return err == nil && ci.NumPending == 0 && ci.NumAckPending == 0 && ci.AckFloor.Stream == uint64(len(ids))
	})
	stop()

	rows, err := b.pg.Pool.Query(ctx, `SELECT event_id, key FROM `+table+` ORDER BY event_id`)
	if err != nil {
		t.Fatal(err)
	}
	type applied struct {
		ID  string
		Key []byte
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[applied])
	if err != nil || len(got) != 2 {
		t.Fatalf("applied = %q (%v), want the two good events once each", got, err)
	}
	for _, a := range got {
		if !bytes.Equal(a.Key, binKey) || !strings.HasPrefix(a.ID, "bin:") {
			t.Errorf("applied %q with key %q, want a bin: id and key %q", a.ID, a.Key, binKey)
		}
	}
	dead, err := inbox.ListDeadLetters(ctx, b.pg.Pool, b.fn, 10)
	if err != nil || len(dead) != 1 || dead[0].Reason != "permanent" || !bytes.Equal(dead[0].Key, binKey) {
		t.Fatalf("dead letters = %+v (%v), want the permanent event with its binary key", dead, err)
	}
	found := false
	for _, h := range dead[0].Headers {
		if string(h.Key) == "x-odd" && string(h.Value) == "v\x00\xfe" {
			found = true
		}
	}
	if !found {
		t.Errorf("dead letter headers %q lack x-odd with its bytes", dead[0].Headers)
	}
	var keys [][]byte
	if err := b.pg.Pool.QueryRow(ctx, `SELECT array_agg(event_key) FROM kfn.outbox`).Scan(&keys); err != nil || len(keys) != 2 || !bytes.Equal(keys[0], binKey) {
		t.Errorf("outbox keys = %q (%v), want the binary key twice", keys, err)
	}
	if n := w.Stats().InfraRetries.Load(); n != 0 {
		t.Errorf("infrastructure retries = %d, want 0", n)
	}
}

// TestHandlerThatSwallowsAFailedStatementDoesNotStall: a handler copies the
// record's value into a text column, ignores the error Postgres returns for
// the one value holding NUL, and returns nil. Its transaction is aborted, so
// kfn's outbox write (with Emit) or the commit (without) fails; that is the
// record's fault, found record by record and dead-lettered, never retried
// as an infrastructure error.
func TestHandlerThatSwallowsAFailedStatementDoesNotStall(t *testing.T) {
	for _, emit := range []bool{true, false} {
		t.Run(fmt.Sprintf("emit=%v", emit), func(t *testing.T) {
			b := setup(t, 1)
			b.cfg.NoRelay = true
			table := pgx.Identifier{"texts_" + b.fn}.Sanitize()
			subject := "texts." + b.fn
			fn := runtime.Function{
				Name: b.fn, Topic: b.topic, Emits: []string{subject},
				Setup: func(ctx context.Context, tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` ("offset" bigint, value text)`)
					return err
				},
				Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
					tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1, $2)`, rec.Offset, string(rec.Value)) //nolint:errcheck // the bug under test
					if emit {
						out.Emit(runtime.Event{Subject: subject, Data: rec.Value})
					}
					return nil
				},
			}
			values := [][]byte{[]byte("a"), []byte("b"), []byte("c\x00d"), []byte("e"), []byte("f")}
			b.produce(t, 0, values...)
			w, stop := b.run(t, fn)
			b.waitCaughtUp(t, b.fn)
			stop()

			var offsets []int64
			rows, err := b.pg.Pool.Query(context.Background(), `SELECT "offset" FROM `+table+` ORDER BY "offset"`)
			if err == nil {
				offsets, err = pgx.CollectRows(rows, pgx.RowTo[int64])
			}
			if err != nil || fmt.Sprint(offsets) != "[0 1 3 4]" {
				t.Errorf("applied offsets %v (%v), want [0 1 3 4] once each", offsets, err)
			}
			dead, err := inbox.ListDeadLetters(context.Background(), b.pg.Pool, b.fn, 10)
			if err != nil || len(dead) != 1 || dead[0].Offset != 2 || dead[0].Reason != "handler_error" || !strings.Contains(dead[0].Error, "did not return its error") {
				t.Errorf("dead letters = %+v (%v), want offset 2 as a handler_error that says the handler swallowed a failure", dead, err)
			}
			if n := w.Stats().InfraRetries.Load(); n != 0 {
				t.Errorf("infrastructure retries = %d, want 0", n)
			}
		})
	}
}
