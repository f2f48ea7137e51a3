package runtime_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// retryAll marks every dead letter of fn for retry and waits for the
// outcomes.
func retryAll(t *testing.T, b *bundle, fn, why string) (inbox.RetryMarks, []inbox.RetryOutcome) {
	t.Helper()
	ctx := context.Background()
	marks, err := operator.Retry(ctx, b.pg.Pool, operator.RetryRequest{Function: fn, Partition: -1, Reason: why, Actor: "test"})
	if err != nil {
		t.Fatal(err)
	}
	outcomes, err := operator.WaitRetries(ctx, b.pg.Pool, marks, 60*time.Second, 50*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	return marks, outcomes
}

// Three workers share a 6-partition topic while records flow. Poison
// records are dead-lettered until the handler is fixed; then every dead
// letter is retried, twice over and once more at the end, while records
// keep coming and one worker leaves (its lanes move with retries pending).
// Nothing is lost or applied twice, events included; the poison records
// end up applied, and the records that still fail stay dead-lettered with
// their retries counted.
func TestDeadLetterRetryUnderLoadWithThreeWorkersLosesAndDuplicatesNothing(t *testing.T) {
	const partitions, rounds, perRound = 6, 40, 10
	b := setup(t, partitions)
	b.cfg.LeaseTTL, b.cfg.LeaseRenew = 2*time.Second, 500*time.Millisecond
	var fixed atomic.Bool
	fn := effects.Function(b.fn, b.topic)
	apply := fn.Handler
	fn.Handler = func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
		if strings.HasPrefix(string(rec.Value), "poison") && !fixed.Load() {
			return runtime.Permanent(errors.New("poison pill"))
		}
		return apply(ctx, tx, rec, out)
	}
	ctx := context.Background()
	var workers []*worker.Worker
	var stops []func()
	for i := range 3 {
		cfg := b.cfg
		cfg.WorkerID = fmt.Sprintf("w%d", i+1)
		w, err := worker.New(ctx, cfg, fn)
		if err != nil {
			t.Fatal(err)
		}
		workers = append(workers, w)
		stops = append(stops, kfntest.Background(t, cfg.WorkerID, w.Run))
	}

	var produced, stillBroken []effects.Produced
	var marked []inbox.RetryMarks
	for r := range rounds {
		for p := range partitions {
			values := make([][]byte, perRound)
			for i := range values {
				n := r*perRound + i
				switch {
				case n%50 == 7:
					values[i] = []byte(effects.Permanent) // fails on every retry too
				case n%13 == 5:
					values[i] = fmt.Appendf(nil, "poison-%d-%d", p, n)
				default:
					values[i] = fmt.Appendf(nil, "v-%d-%d", p, n)
				}
			}
			out := b.produce(t, int32(p), values...)
			produced = append(produced, out...)
			for i, v := range values {
				if string(v) == effects.Permanent {
					stillBroken = append(stillBroken, out[i])
				}
			}
		}
		switch r {
		case 15:
			waitFor(t, 30*time.Second, "poison records dead-lettered", func() bool {
				var n int
				return b.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.dead_letters WHERE consumer = $1 AND value LIKE 'poison%'`, b.fn).Scan(&n) == nil && n > 10
			})
			fixed.Store(true)
			fallthrough
		case 25:
			m, err := operator.Retry(ctx, b.pg.Pool, operator.RetryRequest{Function: b.fn, Partition: -1, Reason: fmt.Sprintf("round %d", r), Actor: "test"})
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("round %d: marked %d dead letters for retry, %d refused", r, len(m.Marked), len(m.Refused))
			marked = append(marked, m)
		case 20:
			stops[2]() // w3 leaves: its lanes move, with retries pending
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, m := range marked {
		outcomes, err := operator.WaitRetries(ctx, b.pg.Pool, m, 60*time.Second, 50*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range outcomes {
			if o.Outcome == inbox.RetryPending {
				t.Errorf("retry of dead letter %d still pending after a minute", o.ID)
			}
		}
	}
	b.waitCaughtUp(t, b.fn)
	// Poison records dead-lettered while the fix went out, after the
	// marking, are retried now; the permanent ones fail again.
	marks, outcomes := retryAll(t, b, b.fn, "the rest")
	failed := 0
	for _, o := range outcomes {
		if o.Outcome == inbox.RetryFailedAgain {
			failed++
		}
	}
	if len(marks.Marked) != len(stillBroken) || failed != len(stillBroken) {
		t.Errorf("final retry: %d marked, %d failed again; want the %d permanent records, all failing", len(marks.Marked), failed, len(stillBroken))
	}
	waitFor(t, 60*time.Second, "the relays to publish every event", func() bool {
		var n int
		return b.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.outbox WHERE source = $1`, b.fn).Scan(&n) == nil && n == 0
	})
	stops[0]()
	stops[1]()

	var applied, failedAgain int64
	for _, w := range workers {
		applied += w.Stats().DeadLetterRetriesApplied.Load()
		failedAgain += w.Stats().DeadLetterRetriesFailed.Load()
	}
	rep := b.check(t, b.fn, produced, stillBroken...)
	t.Logf("%d records, %d retried and applied (workers counted %d), %d retries failed again", len(produced), rep.Retried, applied, failedAgain)
	if rep.Retried == 0 || int64(rep.Retried) != applied {
		t.Errorf("records applied by a retry: %d in the audit log, %d in the workers' stats; want the same, above 0", rep.Retried, applied)
	}
	var minAttempts int
	if err := b.pg.Pool.QueryRow(ctx, `SELECT min(attempts) FROM kfn.dead_letters WHERE consumer = $1`, b.fn).Scan(&minAttempts); err != nil || minAttempts < 2 {
		t.Errorf("the letters that stay have at least %d attempts (%v); want every one retried at least once", minAttempts, err)
	}
}

// A NATS-triggered function's dead letters are retried through the event
// inbox: the event id comes back from the letter's Nats-Msg-Id header, or
// from its stream position when the event had none, so the retried event
// emits what a first apply would have, and a redelivery after the retry is
// skipped.
func TestDeadLetterRetryOnANATSTriggeredFunction(t *testing.T) {
	b := setup(t, 1)
	b.cfg.NoRelay = true // the emitted events stay in the outbox, to be read
	ctx := context.Background()
	js := jetStream(t, b.cfg.NATSURL)
	stream, subject := kfntest.Name(t, "stream"), kfntest.Name(t, "subj")+".created"
	const window = 200 * time.Millisecond
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}, Duplicates: window}); err != nil {
		t.Fatal(err)
	}
	publish := func(id, data string) uint64 {
		t.Helper()
		msg := nats.NewMsg(subject)
		if id != "" {
			msg.Header.Set(jetstream.MsgIDHeader, id)
		}
		msg.Header.Set("kfn-key", "key-"+data)
		msg.Data = []byte(data)
		ack, err := js.PublishMsg(ctx, msg)
		if err != nil {
			t.Fatal(err)
		}
		return ack.Sequence
	}
	publish("ev-1", "ok-1")
	publish("ev-2", "poison-2")
	anonymous := publish("", "poison-3")
	publish("ev-4", "ok-4")

	var fixed atomic.Bool
	table := pgx.Identifier{"events_" + b.fn}.Sanitize()
	emits := kfntest.Name(t, "out") + ".done"
	fn := runtime.Function{
		Name: b.fn, Subject: subject, Stream: stream, Emits: []string{emits},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` (event_id text, key text, subject text)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			if strings.HasPrefix(string(rec.Value), "poison") && !fixed.Load() {
				return runtime.Permanent(errors.New("poison pill"))
			}
			if _, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1, $2, $3)`, rec.EventID, string(rec.Key), rec.Topic); err != nil {
				return err
			}
			out.Emit(runtime.Event{Subject: emits, Data: rec.Value})
			return nil
		},
	}
	_, stop := b.run(t, fn)
	waitFor(t, 30*time.Second, "every event handled", func() bool {
		var n int
		err := b.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.event_inbox WHERE consumer = $1`, b.fn).Scan(&n)
		return err == nil && n == 4
	})
	fixed.Store(true)
	marks, outcomes := retryAll(t, b, b.fn, "fixed")
	if len(marks.Marked) != 2 || len(outcomes) != 2 || outcomes[0].Outcome != inbox.RetryApplied || outcomes[1].Outcome != inbox.RetryApplied {
		t.Fatalf("retry = %+v, outcomes %+v; want the two poison events applied", marks, outcomes)
	}
	// The same event again, past the duplicate window: the inbox skips it.
	time.Sleep(2 * window)
	publish("ev-2", "poison-2")
	publish("ev-5", "ok-5")
	waitFor(t, 30*time.Second, "the later events handled", func() bool {
		var n int
		err := b.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.event_inbox WHERE consumer = $1`, b.fn).Scan(&n)
		return err == nil && n == 5
	})
	stop()

	rows, err := b.pg.Pool.Query(ctx, `SELECT event_id, key, subject FROM `+table+` ORDER BY event_id`)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	var id, key, subj string
	if _, err := pgx.ForEachRow(rows, []any{&id, &key, &subj}, func() error {
		if subj != subject {
			t.Errorf("event %s reached the handler on subject %q, want %q", id, subj, subject)
		}
		got = append(got, id+"="+key)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	anonymousID := fmt.Sprintf("stream/%s/%d", stream, anonymous)
	want := []string{"ev-1=key-ok-1", "ev-2=key-poison-2", "ev-4=key-ok-4", "ev-5=key-ok-5", anonymousID + "=key-poison-3"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("applied events = %v, want each once: %v", got, want)
	}
	var outcomesInInbox string
	if err := b.pg.Pool.QueryRow(ctx, `SELECT string_agg(DISTINCT outcome, ',') FROM kfn.event_inbox WHERE consumer = $1`, b.fn).Scan(&outcomesInInbox); err != nil || outcomesInInbox != "applied" {
		t.Errorf("event inbox outcomes = %q (%v), want all applied", outcomesInInbox, err)
	}
	for _, ev := range []string{"ev-2", anonymousID} {
		var n int
		want := outbox.EventID(b.fn, outbox.SourceID(subject, 0, 0, ev, 0), 0)
		if err := b.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.outbox WHERE event_id = $1`, want).Scan(&n); err != nil || n != 1 {
			t.Errorf("outbox rows with %s's first-apply event id %s = %d (%v), want 1", ev, want, n, err)
		}
	}
	var left int
	if err := b.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.dead_letters WHERE consumer = $1`, b.fn).Scan(&left); err != nil || left != 0 {
		t.Errorf("%d dead letters left (%v), want none", left, err)
	}
}
