package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/naming"
	"github.com/kfn-dev/kfn/internal/observe"
	"github.com/kfn-dev/kfn/outbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// This file applies the dead letters an operator marked for retry (`kfn dlq
// retry`, inbox.MarkForRetry). The lane that owns a letter's partition (or
// subject) applies it, between two batches of records, in a transaction of
// its own under its own fence:
//
//	fence (inbox.FenceLane: the cursor row, written under the lane's token, not moved)
//	take the letter (inbox.TakeForRetry: DELETE … WHERE still marked)
//	inbox row dead_lettered → applied (or written again if retention purged it)
//	the handler, the outbox rows (event ids as a first apply would have had them)
//	audit dlq_retry_applied
//	COMMIT
//
// The letter leaves in the transaction that applies it, so a letter is
// applied at most once, whatever the lanes, workers or operators do: a
// second retry finds no marked letter. A retry that fails (the handler, or a
// record that cannot be rebuilt) rolls back and is recorded in a second
// fenced transaction: the letter stays, unmarked, with its attempts counted
// and the new error. A retry gets one handler call, and a lane applies at
// most retryChunk letters between two batches, so retries never stall a
// lane.
//
// Finding the work: each worker runs one query every retryPollEvery for all
// its functions (inbox.PendingRetryLanes, on a partial index that holds only
// marked letters), and runs it at once when notified on
// inbox.RetryNotifyChannel (MarkForRetry notifies at commit; a LISTEN
// connection of the worker's own). It wakes the lanes it owns that have
// marked letters, and those holding parked keys (they read them again); a
// lane waiting for records stops waiting.
//
// Parked keys (KeyOrder ParkKey, applier_parkkey.go): applying a letter that
// blocks its key releases the key in the same transaction, marking its
// key_parked letters for retry; a key_parked letter is not applied while
// its key is parked behind an earlier letter (it is unmarked, and audited
// as a failed retry saying so); one whose retry fails blocks its key in
// turn, in the transaction that records the failure.

// retryPollEvery is how often a worker looks for dead letters marked for
// retry, besides the notifications.
const retryPollEvery = 3 * time.Second

// retryChunk is how many marked letters a lane applies before it reads
// records again.
const retryChunk = 100

// errRetryWake ends a lane's wait for records: letters were marked for
// retry.
var errRetryWake = errors.New("woken to retry dead letters")

// retryLanes are the worker's running lanes, for waking the ones with
// letters to retry.
type retryLanes struct {
	mu    sync.Mutex
	lanes map[inbox.Partition]*retryLane
}

func newRetryLanes() *retryLanes { return &retryLanes{lanes: map[inbox.Partition]*retryLane{}} }

// retryLane is one running lane's side of retries.
type retryLane struct {
	a       *applier
	stream  string      // a subject lane's stream: the event id of an event published without Nats-Msg-Id names it
	pending atomic.Bool // letters may be marked: look before the next fetch
	wake    chan struct{}
}

// register adds a lane that starts; it looks for marked letters once
// before it reads records. A nil registry registers nothing.
func (r *retryLanes) register(a *applier, stream string) *retryLane {
	if r == nil {
		return nil
	}
	l := &retryLane{a: a, stream: stream, wake: make(chan struct{}, 1)}
	l.pending.Store(true)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lanes[a.part] = l
	return l
}

// unregister removes a lane that stopped.
func (r *retryLanes) unregister(l *retryLane) {
	if r == nil || l == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.lanes[l.a.part] == l {
		delete(r.lanes, l.a.part)
	}
}

// signal wakes the lane of p if this worker runs it.
func (r *retryLanes) signal(p inbox.Partition) {
	r.mu.Lock()
	l := r.lanes[p]
	r.mu.Unlock()
	if l != nil {
		l.signal()
	}
}

// signalHolding wakes the lanes that hold parked keys (KeyOrder ParkKey),
// so that they read their partition's parked keys again.
func (r *retryLanes) signalHolding() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, l := range r.lanes {
		if l.a.held != nil && l.a.held.count.Load() > 0 {
			l.signal()
		}
	}
}

func (l *retryLane) signal() {
	l.pending.Store(true)
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// waitContext returns the context for a lane's wait for its next record:
// ctx, also cancelled with cause errRetryWake when the lane is signalled.
// Use it for the wait for a batch's first record only: a batch cut short
// would lose the records already read from the reader.
func (l *retryLane) waitContext(ctx context.Context) (context.Context, func()) {
	if l == nil {
		return ctx, func() {}
	}
	wctx, cancel := context.WithCancelCause(ctx)
	stop := make(chan struct{})
	go func() {
		select {
		case <-l.wake:
			cancel(errRetryWake)
		case <-stop:
		case <-wctx.Done():
		}
	}()
	return wctx, func() {
		close(stop)
		cancel(nil)
	}
}

// wokenForRetry reports whether the wait on wctx (from waitContext) ended
// because letters were marked for retry.
func wokenForRetry(wctx context.Context) bool {
	return errors.Is(context.Cause(wctx), errRetryWake)
}

// applyPending applies up to retryChunk of the lane's marked letters, in
// offset order, if it was signalled. It returns only when ctx ends or the
// lane is fenced; infrastructure errors are retried.
func (l *retryLane) applyPending(ctx context.Context) error {
	if l == nil || !l.pending.Swap(false) {
		return nil
	}
	return retryInfra(ctx, l.a.repeats, l.a.log, "retry dead letters", func(ctx context.Context) error {
		ids, err := inbox.PendingRetries(ctx, l.a.pool, l.a.part, retryChunk)
		if err != nil {
			return err
		}
		for _, id := range ids {
			if err := l.retry(ctx, id); err != nil {
				return err
			}
		}
		if len(ids) == retryChunk {
			l.signal() // more after the next batch
		}
		// Keys released by others (a discard) are free again, or held
		// until their parked records are applied.
		return l.a.reloadHeld(ctx)
	})
}

// retry applies dead letter id, or records why it could not.
func (l *retryLane) retry(ctx context.Context, id int64) error {
	letter, released, cause, err := l.tryApply(ctx, id)
	if err != nil {
		return err
	}
	if cause != nil {
		return l.recordFailure(ctx, letter, cause)
	}
	// A blocker applied: its key's parked records are marked for retry,
	// and the key stays held until they are applied.
	for _, r := range released {
		if l.a.held != nil {
			if r.Marked > 0 {
				l.a.held.set(inbox.HeldKey{Key: r.Key, Offset: r.BlockingOffset, Released: true})
			} else {
				l.a.held.drop([]string{string(r.Key)})
			}
		}
		l.a.log.Info("key released: its blocking dead letter was retried; its parked records follow in offset order",
			"key", describeKey(r.Key), "blocking_offset", r.BlockingOffset, "parked_records", r.Marked)
		if r.Marked > 0 {
			l.signal()
		}
	}
	return nil
}

// tryApply takes letter id and applies its record in one fenced
// transaction. cause is why the retry failed (the transaction rolled back,
// the letter is back); err is an infrastructure error or an
// *inbox.FencedError. Both are nil when the record was applied or the
// letter was not there to take. released are the keys the letter blocked
// (KeyOrder ParkKey), released in the same transaction.
func (l *retryLane) tryApply(ctx context.Context, id int64) (letter inbox.RetryLetter, released []inbox.ReleasedKey, cause, err error) {
	a := l.a
	conn, tx, err := a.begin(ctx)
	if err != nil {
		return letter, nil, nil, err
	}
	abandoned := false
	defer func() {
		if abandoned {
			return // the abandoned handler's goroutine still holds tx; its connection is out of the pool
		}
		tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit
		conn.pooled.Release()
	}()
	if err := inbox.FenceLane(ctx, tx, a.part, a.token); err != nil {
		return letter, nil, nil, err
	}
	letter, found, err := inbox.TakeForRetry(ctx, tx, a.part, id)
	switch {
	case !found:
		return letter, nil, nil, err
	case err != nil: // its bytes do not decode
		return letter, nil, err, nil
	}
	_, kafkaLane := a.tracker.(*partitionTracker)
	if kafkaLane && letter.Reason == inbox.ReasonKeyParked && letter.Key != nil {
		// A parked record never goes before the dead letter its key is
		// parked behind, whoever marked it.
		blocking, behind, err := inbox.ParkedBehind(ctx, tx, a.part, letter.Key, letter.Offset)
		if err != nil {
			return letter, nil, nil, err
		}
		if behind {
			return letter, nil, &heldBackError{blockingOffset: blocking}, nil
		}
	}
	rec, err := l.record(letter)
	if err != nil {
		return letter, nil, err, nil
	}
	switch t := a.tracker.(type) {
	case *partitionTracker:
		err = inbox.MarkRetryApplied(ctx, tx, a.part, a.token, rec.Offset)
	case *subjectTracker:
		rec.Topic, err = inbox.MarkEventRetryApplied(ctx, tx, t.consumer, a.token, inbox.EventRef{ID: rec.EventID, Subject: rec.Topic, StreamSeq: rec.Offset})
	default:
		return letter, nil, errors.New("this lane does not retry dead letters"), nil
	}
	if errors.Is(err, inbox.ErrAlreadyApplied) {
		return letter, nil, err, nil
	}
	if err != nil {
		return letter, nil, nil, err
	}
	recs := []kfn.Record{rec}
	rows, _, emitted, failure := a.runHandlers(ctx, conn, tx, recs, recs, false)
	if failure != nil {
		abandoned = isAbandoned(failure.err)
		if ctx.Err() != nil { // the lane is stopping: the letter stays marked for its next owner
			return letter, nil, nil, fmt.Errorf("retry of dead letter %d on %s interrupted: %w", id, a.part, failure.err)
		}
		return letter, nil, failure.err, nil
	}
	if err := outbox.Write(ctx, tx, outboxMode(a.cfg), rows); err != nil {
		if failure := recordsFault(recs, "write the outbox rows", err); failure != nil {
			return letter, nil, failure.err, nil
		}
		return letter, nil, nil, err
	}
	if err := inbox.AuditRetryApplied(ctx, tx, a.cfg.WorkerID, letter, a.token, rec.EventID); err != nil {
		return letter, nil, nil, err
	}
	if kafkaLane {
		// The letter may have blocked its key (KeyOrder ParkKey): release
		// it, marking its parked records for retry, in this transaction.
		if released, err = inbox.ReleaseKeys(ctx, tx, a.cfg.WorkerID, "retried", []inbox.LetterRef{{Partition: a.part, Offset: letter.Offset}}); err != nil {
			return letter, nil, nil, err
		}
	}
	// As in commit: once COMMIT is sent, wait for its reply. A commit whose
	// reply is lost is safe to retry: the letter is gone if it landed.
	if err := tx.Commit(context.WithoutCancel(ctx)); err != nil {
		if failure := recordsFault(recs, "commit", err); failure != nil {
			return letter, nil, failure.err, nil
		}
		return letter, nil, nil, fmt.Errorf("commit the retry of dead letter %d on %s: %w", id, a.part, err)
	}
	a.stats.DeadLetterRetriesApplied.Add(1)
	a.stats.TraceContextDropped.Add(int64(emitted.traceDropped))
	a.stats.CountFn(a.fn.Name, func(c *observe.FunctionCounters) {
		c.DeadLetterRetriesApplied++
		c.TraceContextDropped += int64(emitted.traceDropped)
	})
	a.log.Info("dead letter retried: applied", "dead_letter_id", id, "offset", rec.Offset, "requested_by", letter.Actor, "reason", letter.Why)
	return letter, released, nil, nil
}

// record rebuilds the record of a dead letter, as the lane read it.
func (l *retryLane) record(d inbox.RetryLetter) (kfn.Record, error) {
	if d.ValueSHA256 != nil || d.Reason == "oversized" {
		return kfn.Record{}, fmt.Errorf("%w: the dead letter keeps only part of the record; re-read it from Kafka with kfn replay", errRetryOversized)
	}
	rec := kfn.Record{
		Topic: d.Partition.Topic, Partition: d.Partition.Partition, Offset: d.Offset,
		Key: d.Key, Value: d.Value, Time: d.RecordTime, Attempt: d.Attempts + 1,
	}
	for _, h := range d.Headers {
		rec.Headers = append(rec.Headers, kfn.Header{Key: string(h.Key), Value: h.Value})
	}
	if _, ok := l.a.tracker.(*subjectTracker); ok {
		rec.EventID = retriedEventID(rec, l.stream)
	}
	if size := recordSize(rec); size > l.a.cfg.MaxRecordBytes {
		return kfn.Record{}, fmt.Errorf("%w: record is %d bytes (key, value and headers), over the %d-byte limit (--max-record-bytes)", errRetryOversized, size, l.a.cfg.MaxRecordBytes)
	}
	return rec, nil
}

// retriedEventID recovers the event id of a dead-lettered JetStream event,
// as eventRecord derived it: its Nats-Msg-Id, which the dead letter keeps
// with the event's other headers, or its stream position when it had none.
func retriedEventID(rec kfn.Record, stream string) string {
	v, _ := rec.Header(jetstream.MsgIDHeader)
	return naming.EventIDOf(string(v), stream, rec.Offset)
}

// recordFailure records, in a fenced transaction of its own, that the retry
// of letter failed with cause.
func (l *retryLane) recordFailure(ctx context.Context, letter inbox.RetryLetter, cause error) error {
	a := l.a
	tx, err := a.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin transaction on %s: %w", a.part, err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit
	if err := inbox.FenceLane(ctx, tx, a.part, a.token); err != nil {
		return err
	}
	var heldBack *heldBackError
	if errors.As(cause, &heldBack) {
		recorded, err := inbox.RetryHeldBack(ctx, tx, a.cfg.WorkerID, letter, a.token, heldBack.blockingOffset)
		if err != nil {
			return err
		}
		if err := tx.Commit(context.WithoutCancel(ctx)); err != nil {
			return fmt.Errorf("commit the held-back retry of dead letter %d on %s: %w", letter.ID, a.part, err)
		}
		if recorded {
			a.stats.DeadLetterRetriesFailed.Add(1)
			a.log.Warn("dead letter not retried: its key is parked behind an earlier dead letter", "dead_letter_id", letter.ID,
				"offset", letter.Offset, "blocking_offset", heldBack.blockingOffset)
		}
		return nil
	}
	recorded, err := inbox.RetryFailed(ctx, tx, a.cfg.WorkerID, letter, a.token, cause.Error())
	if err != nil {
		return err
	}
	// A parked record that fails when its key is released blocks the key in
	// its turn: the key's later parked records must wait behind it.
	_, kafkaLane := a.tracker.(*partitionTracker)
	blocked := false
	if kafkaLane && letter.Reason == inbox.ReasonKeyParked && letter.Key != nil {
		if blocked, err = inbox.BlockAfterFailedRetry(ctx, tx, letter, retryFailureReason(cause), cause.Error()); err != nil {
			return err
		}
	}
	if err := tx.Commit(context.WithoutCancel(ctx)); err != nil {
		return fmt.Errorf("commit the failed retry of dead letter %d on %s: %w", letter.ID, a.part, err)
	}
	if blocked && a.held != nil {
		a.held.set(inbox.HeldKey{Key: letter.Key, Offset: letter.Offset})
	}
	if recorded {
		a.stats.DeadLetterRetriesFailed.Add(1)
		a.stats.CountFn(a.fn.Name, func(c *observe.FunctionCounters) { c.DeadLetterRetriesFailed++ })
		a.log.Warn("dead letter retried: failed again; the letter stays", "dead_letter_id", letter.ID, "offset", letter.Offset,
			"attempts", letter.Attempts+1, "err", observe.FirstLine(cause))
	}
	if blocked {
		a.log.Warn("parked record failed when its key was released: it parks the key's later records in turn",
			"dead_letter_id", letter.ID, "offset", letter.Offset, "key", describeKey(letter.Key), "reason", retryFailureReason(cause))
	}
	return nil
}
