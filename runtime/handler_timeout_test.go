package runtime_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/runtime"
)

// hangs wraps the effects function: a record whose value is "hang" runs
// misbehave instead (once the effect row is written, so that the test sees
// whether the transaction was rolled back). It counts those calls.
func hangs(fn runtime.Function, calls *atomic.Int32, misbehave func(ctx context.Context, tx pgx.Tx) error) runtime.Function {
	apply := fn.Handler
	fn.Handler = func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
		if string(rec.Value) != "hang" {
			return apply(ctx, tx, rec, out)
		}
		calls.Add(1)
		if err := apply(ctx, tx, rec, out); err != nil {
			return err
		}
		return misbehave(ctx, tx)
	}
	return fn
}

// TestHandlerIgnoringItsContextIsAbandoned: a handler that blocks without
// looking at its ctx must not hold its lane. Once it overruns
// --handler-timeout, kfn ends its transaction's session (rolling back what
// it wrote), dead-letters the record with reason timeout without calling
// the handler again, goes on with the records after it, and counts the
// handler as still running until it returns. The lane stands still for the
// timeout plus the abandon grace and one dead-letter transaction.
func TestHandlerIgnoringItsContextIsAbandoned(t *testing.T) {
	b := setup(t, 1)
	b.cfg.HandlerTimeout = time.Second
	b.cfg.NoRelay = true
	release := make(chan struct{})
	afterRelease := make(chan error, 1)
	var calls atomic.Int32
	var hungAt atomic.Int64
	fn := hangs(effects.Function(b.fn, b.topic), &calls, func(_ context.Context, tx pgx.Tx) error {
		hungAt.Store(time.Now().UnixNano())
		<-release // ignores ctx
		// The transaction is gone: its session was ended.
		_, err := tx.Exec(context.Background(), `SELECT 1`)
		afterRelease <- err
		return nil
	})
	produced := b.produce(t, 0, []byte("a"), []byte("b"), []byte("hang"), []byte("c"), []byte("d"))
	w, stop := b.run(t, fn)
	defer stop()
	b.waitCaughtUp(t, b.fn)

	dead, err := inbox.ListDeadLetters(context.Background(), b.pg.Pool, b.fn, 10)
	if err != nil || len(dead) != 1 || dead[0].Offset != 2 || dead[0].Reason != "timeout" || dead[0].Attempts != 1 {
		t.Fatalf("dead letters = %+v (%v), want offset 2 with reason timeout after 1 attempt", dead, err)
	}
	stood := dead[0].DeadAt.Sub(time.Unix(0, hungAt.Load()))
	limit := b.cfg.HandlerTimeout + time.Second /* abandon grace */ + time.Second /* end the session, one transaction */
	t.Logf("the lane stood still %s for the hung handler (handler timeout %s, bound %s, lease TTL %s)", stood.Round(time.Millisecond), b.cfg.HandlerTimeout, limit, settings.DefaultLeaseTTL)
	if stood > limit {
		t.Errorf("the lane stood still %s, more than the handler timeout plus the abandon grace and one transaction (%s)", stood, limit)
	}
	if !strings.Contains(dead[0].Error, "abandoned") {
		t.Errorf("dead letter error %q does not say that the handler was abandoned", dead[0].Error)
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("the hung record's handler was called %d times, want 1: a timeout is not retried", n)
	}
	st := w.Stats()
	if a, r := st.AbandonedHandlers.Load(), st.AbandonedHandlersRunning.Load(); a != 1 || r != 1 {
		t.Errorf("abandoned handlers = %d, still running = %d; want 1 and 1 while the handler blocks", a, r)
	}
	if n := st.InfraRetries.Load(); n != 0 {
		t.Errorf("infrastructure retries = %d, want 0: the timeout is the record's fault", n)
	}

	close(release)
	if err := <-afterRelease; err == nil {
		t.Error("the abandoned handler could still use its transaction")
	}
	waitFor(t, 10*time.Second, "the abandoned handler to be counted as returned", func() bool {
		return st.AbandonedHandlersRunning.Load() == 0
	})
	stop()
	b.check(t, b.fn, produced, offsets(produced, 2)...)
}

// TestHandlerSleepingInAStatementTimesOut: a handler that runs a long
// statement with a ctx of its own (so kfn cannot cancel it) is stopped by
// the session's statement_timeout, which is at most 0.8 ×
// --handler-timeout. That is a timeout as well: the record is dead-lettered
// with reason timeout without another attempt, and no statement is left
// running.
func TestHandlerSleepingInAStatementTimesOut(t *testing.T) {
	b := setup(t, 1)
	b.cfg.HandlerTimeout = time.Second
	b.cfg.NoRelay = true
	var calls atomic.Int32
	var hungAt atomic.Int64
	fn := hangs(effects.Function(b.fn, b.topic), &calls, func(_ context.Context, tx pgx.Tx) error {
		hungAt.Store(time.Now().UnixNano())
		_, err := tx.Exec(context.Background(), `SELECT pg_sleep(3600)`)
		return err
	})
	produced := b.produce(t, 0, []byte("a"), []byte("hang"), []byte("b"))
	w, stop := b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()

	dead, err := inbox.ListDeadLetters(context.Background(), b.pg.Pool, b.fn, 10)
	if err != nil || len(dead) != 1 || dead[0].Offset != 1 || dead[0].Reason != "timeout" || dead[0].Attempts != 1 {
		t.Fatalf("dead letters = %+v (%v), want offset 1 with reason timeout after 1 attempt", dead, err)
	}
	stood := dead[0].DeadAt.Sub(time.Unix(0, hungAt.Load()))
	limit := b.cfg.HandlerTimeout + time.Second /* one transaction */
	t.Logf("the lane stood still %s for the sleeping statement (handler timeout %s, bound %s)", stood.Round(time.Millisecond), b.cfg.HandlerTimeout, limit)
	if stood > limit {
		t.Errorf("the lane stood still %s, more than the handler timeout plus one transaction (%s)", stood, limit)
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("the sleeping record's handler was called %d times, want 1", n)
	}
	var sleeping int
	if err := b.pg.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(3600)' AND state = 'active'`).Scan(&sleeping); err != nil || sleeping != 0 {
		t.Errorf("%d statements still sleeping (%v), want 0", sleeping, err)
	}
	if a := w.Stats().AbandonedHandlers.Load(); a != 0 {
		t.Errorf("abandoned handlers = %d, want 0: the handler returned the statement's error", a)
	}
	b.check(t, b.fn, produced, offsets(produced, 1)...)
}

// TestBatchHandlerIgnoringItsContextIsAbandoned: with a batch handler the
// culprit of a timeout is unknown, so the batch goes on one record at a
// time; the hung record is abandoned a second time on its own and
// dead-lettered, and every other record of the batch is applied once.
func TestBatchHandlerIgnoringItsContextIsAbandoned(t *testing.T) {
	b := setup(t, 1)
	b.cfg.HandlerTimeout = time.Second
	b.cfg.NoRelay = true
	fn := effects.BatchFunction(b.fn, b.topic)
	apply := fn.BatchHandler
	var hung atomic.Int32
	stuck := make(chan struct{})
	defer close(stuck)
	fn.BatchHandler = func(ctx context.Context, tx pgx.Tx, recs []runtime.Record, out *runtime.BatchEvents) error {
		for _, r := range recs {
			if string(r.Value) == "hang" {
				hung.Add(1)
				<-stuck // ignores ctx
				return nil
			}
		}
		return apply(ctx, tx, recs, out)
	}
	values := make([][]byte, 6)
	for i := range values {
		values[i] = []byte(fmt.Sprintf("v%d", i))
	}
	values[3] = []byte("hang")
	produced := b.produce(t, 0, values...) // before the worker starts: one batch
	w, stop := b.run(t, fn)
	defer stop()
	b.waitCaughtUp(t, b.fn)
	if n := hung.Load(); n != 2 {
		t.Errorf("the hung record's batch handler was called %d times, want 2 (in the batch, then alone)", n)
	}
	if a := w.Stats().AbandonedHandlers.Load(); a != 2 {
		t.Errorf("abandoned handlers = %d, want 2", a)
	}
	stop()
	b.check(t, b.fn, produced, offsets(produced, 3)...)
}

// TestShutdownDoesNotWaitForAHungHandler: a worker told to stop while a
// handler ignores its ctx stops within the abandon grace; the record is
// neither applied nor dead-lettered, and the next owner applies it.
func TestShutdownDoesNotWaitForAHungHandler(t *testing.T) {
	b := setup(t, 1)
	b.cfg.HandlerTimeout = time.Minute
	b.cfg.NoRelay = true
	hang := make(chan struct{})
	defer close(hang)
	var calls atomic.Int32
	fn := hangs(effects.Function(b.fn, b.topic), &calls, func(context.Context, pgx.Tx) error {
		<-hang // ignores ctx
		return nil
	})
	produced := b.produce(t, 0, []byte("a"), []byte("hang"))
	_, stop := b.run(t, fn)
	waitFor(t, 30*time.Second, "the handler to hang", func() bool { return calls.Load() == 1 })
	start := time.Now()
	stop()
	stopped := time.Since(start)
	t.Logf("the worker stopped %s after it was told to, with a handler hung", stopped.Round(time.Millisecond))
	if stopped > 3*time.Second {
		t.Errorf("stopping took %s: it waited for the hung handler", stopped)
	}

	// The next owner applies the record, which now behaves.
	next := effects.Function(b.fn, b.topic)
	_, stop = b.run(t, next)
	b.waitCaughtUp(t, b.fn)
	stop()
	b.check(t, b.fn, produced)
}

// TestKeyLaneHandlerTimeoutHoldsOnlyItsKeyLane: with 16 key-lanes, a
// handler that hangs (ignoring its ctx) on the first record of one key
// holds only that key's key-lane. While it hangs, the other keys' records
// are applied; once it overruns --handler-timeout it is abandoned and its
// record dead-lettered with reason timeout after one attempt; every other
// record is applied once, each key's in order, and the cursor reaches the
// end. With one lane the whole partition would wait out the timeout.
func TestKeyLaneHandlerTimeoutHoldsOnlyItsKeyLane(t *testing.T) {
	b := setup(t, 1)
	b.cfg.HandlerTimeout = 3 * time.Second
	b.cfg.NoRelay = true
	release := make(chan struct{})
	var calls atomic.Int32
	var hungAt atomic.Int64
	fn := hangs(effects.Function(b.fn, b.topic), &calls, func(context.Context, pgx.Tx) error {
		hungAt.Store(time.Now().UnixNano())
		<-release // ignores ctx
		return nil
	})
	fn.KeyConcurrency = keyLaneCount
	const n, keys, hungOffset = 400, 20, 7 // the hung record: key k7's first
	msgs := make([]kafka.Message, n)
	produced := make([]effects.Produced, n)
	for i := range msgs {
		key := fmt.Sprintf("k%d", i%keys)
		msgs[i] = kafka.Message{Partition: 0, Key: []byte(key), Value: effects.KeyedValue(key, i/keys+1)}
		if i == hungOffset {
			msgs[i].Value = []byte("hang")
		}
		produced[i] = effects.Produced{Partition: 0, Offset: int64(i)}
	}
	b.kafka.Produce(t, b.topic, msgs...)
	w, stop := b.run(t, fn)
	defer stop()
	defer close(release)

	// While the handler hangs, at least half the records (the other key-lanes'
	// share is about 15/16 of them) are applied.
	waitFor(t, 10*time.Second, "the handler to hang", func() bool { return hungAt.Load() != 0 })
	waitFor(t, b.cfg.HandlerTimeout, "the other key-lanes to apply half the records while one handler hangs", func() bool {
		return w.Stats().Applied.Load() >= n/2
	})
	whileHung := time.Since(time.Unix(0, hungAt.Load()))
	if d, err := inbox.ListDeadLetters(context.Background(), b.pg.Pool, b.fn, 10); err != nil || len(d) != 0 {
		t.Fatalf("dead letters %+v (%v) before the handler timeout: half the records must be applied while it still hangs", d, err)
	}
	t.Logf("%d of %d records applied %s after the handler hung (handler timeout %s)", w.Stats().Applied.Load(), n, whileHung.Round(time.Millisecond), b.cfg.HandlerTimeout)

	b.waitCaughtUp(t, b.fn)
	dead, err := inbox.ListDeadLetters(context.Background(), b.pg.Pool, b.fn, 10)
	if err != nil || len(dead) != 1 || dead[0].Offset != hungOffset || dead[0].Reason != "timeout" || dead[0].Attempts != 1 {
		t.Fatalf("dead letters = %+v (%v), want offset %d with reason timeout after 1 attempt", dead, err, hungOffset)
	}
	if c := calls.Load(); c != 1 {
		t.Errorf("the hung record's handler was called %d times, want 1: a timeout is not retried", c)
	}
	stop()
	rep, err := effects.Check(context.Background(), b.pg.Pool, b.fn, b.topic, produced, effects.KeyOrder())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("checker: %s", rep)
	if v := rep.Violations(produced[hungOffset]); len(v) > 0 {
		t.Errorf("exactly-once or key order violated: %s", strings.Join(v, "; "))
	}
}
