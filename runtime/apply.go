package runtime

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/outbox"
)

// handlerFailure is a record whose handler failed; the transaction it ran in
// was rolled back.
type handlerFailure struct {
	index int // position of the failing record in the slice passed to commit
	err   error
}

// apply commits recs (ascending offsets, starting at the cursor) in as few
// transactions as it can. When a handler fails, the records before it are
// committed, the failing record is retried alone with backoff and then
// dead-lettered, and the rest goes on. An error returned is an infrastructure
// error or a *inbox.FencedError; recs below pr.next are committed by then.
func (pr *partitionRun) apply(ctx context.Context, recs []Record) error {
	for len(recs) > 0 {
		n := len(recs)
		for {
			failure, err := pr.commit(ctx, recs[:n], 1)
			if err != nil {
				return err
			}
			if failure == nil {
				break
			}
			if failure.index > 0 {
				n = failure.index // commit the prefix before the failing record
				continue
			}
			if err := pr.retryAlone(ctx, recs[0], failure.err); err != nil {
				return err
			}
			n = 1
			break
		}
		recs = recs[n:]
	}
	return nil
}

// retryAlone retries one record in its own transactions with exponential
// backoff until it commits, fails permanently or runs out of attempts; then
// it dead-letters it.
func (pr *partitionRun) retryAlone(ctx context.Context, rec Record, firstErr error) error {
	cfg := pr.w.cfg
	policy := backoff.NewExponentialBackOff()
	policy.InitialInterval = cfg.RetryInitial
	policy.MaxInterval = cfg.RetryMax
	policy.MaxElapsedTime = 0
	policy.Reset()

	lastErr, attempt := firstErr, 1
	for attempt < cfg.RetryAttempts && !IsPermanent(lastErr) {
		pr.log.Warn("handler failed, retrying", "offset", rec.Offset, "attempt", attempt, "err", firstLine(lastErr))
		if err := sleep(ctx, policy.NextBackOff()); err != nil {
			return err
		}
		attempt++
		pr.w.stats.Retries.Add(1)
		failure, err := pr.commit(ctx, []Record{rec}, attempt)
		if err != nil {
			return err
		}
		if failure == nil {
			return nil
		}
		lastErr = failure.err
	}
	return pr.deadLetter(ctx, rec, lastErr, attempt)
}

// commit tries to apply recs in one transaction. It returns a handlerFailure
// (transaction rolled back, nothing applied) when a handler fails.
func (pr *partitionRun) commit(ctx context.Context, recs []Record, attempt int) (*handlerFailure, error) {
	last := recs[len(recs)-1].Offset
	tx, err := pr.w.pool.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("begin transaction on %s: %w", pr.part, err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit

	fresh, err := pr.fenceAndClaim(ctx, tx, recs)
	if err != nil {
		return nil, err
	}
	duplicates := len(recs) - len(fresh)

	work, oversized := pr.selectWork(recs, fresh, attempt)
	for _, r := range oversized {
		err := fmt.Errorf("record is %d bytes, over the %d-byte limit (--max-record-bytes)", len(r.Key)+len(r.Value), pr.w.cfg.MaxRecordBytes)
		if err := pr.writeDeadLetter(ctx, tx, r, "oversized", err, 0); err != nil {
			return nil, err
		}
	}

	rows, failure := pr.runHandlers(ctx, tx, work, recs)
	if failure != nil {
		if tx.Conn().IsClosed() || ctx.Err() != nil {
			return nil, fmt.Errorf("transaction on %s broke during the handler: %w", pr.part, failure.err)
		}
		return failure, nil
	}
	if err := outbox.Insert(ctx, tx, rows); err != nil {
		return nil, err
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("commit %d records of %s: %w", len(recs), pr.part, err)
	}

	pr.committed(last+1, len(work), duplicates, len(oversized))
	for _, r := range oversized {
		pr.log.Warn("record dead-lettered", "offset", r.Offset, "reason", "oversized", "bytes", len(r.Key)+len(r.Value))
	}
	return nil, nil
}

// fenceAndClaim moves the fenced cursor past recs and claims them in the
// inbox, returning the offsets that were not handled before.
func (pr *partitionRun) fenceAndClaim(ctx context.Context, tx pgx.Tx, recs []Record) ([]int64, error) {
	offsets := make([]int64, 0, len(recs))
	for _, r := range recs {
		offsets = append(offsets, r.Offset)
	}
	if pr.w.guarantee == atLeastOnce {
		return offsets, nil // the benchmark's baseline: no fence, no inbox
	}
	if err := inbox.Advance(ctx, tx, pr.part, pr.token, pr.next, recs[len(recs)-1].Offset+1); err != nil {
		return nil, err
	}
	// Offsets below the high-water mark were handled before (possibly
	// purged from the inbox since); the inbox claim catches the rest.
	candidates := offsets[:0]
	for _, o := range offsets {
		if o >= pr.highWater {
			candidates = append(candidates, o)
		}
	}
	return inbox.Claim(ctx, tx, pr.part, pr.token, inbox.Applied, candidates)
}

// selectWork splits the fresh records into those to hand to the handler and
// those too large to hand to anyone.
func (pr *partitionRun) selectWork(recs []Record, fresh []int64, attempt int) (work, oversized []Record) {
	isFresh := make(map[int64]bool, len(fresh))
	for _, o := range fresh {
		isFresh[o] = true
	}
	for _, r := range recs {
		if !isFresh[r.Offset] {
			continue
		}
		if len(r.Key)+len(r.Value) > pr.w.cfg.MaxRecordBytes {
			oversized = append(oversized, r)
			continue
		}
		r.Attempt = attempt
		work = append(work, r)
	}
	return work, oversized
}

// runHandlers calls the function's handler on work inside tx and returns the
// outbox rows it emitted. On failure the index refers to recs.
func (pr *partitionRun) runHandlers(ctx context.Context, tx pgx.Tx, work, recs []Record) ([]outbox.Row, *handlerFailure) {
	emitter := newEmitCollector(pr.fn.Name, pr.generation)
	indexIn := func(r Record) int {
		for i := range recs {
			if recs[i].Offset == r.Offset {
				return i
			}
		}
		panic("record not in batch")
	}
	if pr.fn.BatchHandler != nil {
		if len(work) == 0 {
			return nil, nil
		}
		err := pr.call(ctx, func(ctx context.Context) error {
			return pr.fn.BatchHandler(ctx, tx, work, &BatchEvents{emit: emitter.emit})
		})
		if err == nil {
			err = emitter.err
		}
		if err != nil {
			if len(recs) > 1 {
				// Unknown culprit: go one record at a time from the first.
				return nil, &handlerFailure{index: 1, err: err}
			}
			return nil, &handlerFailure{index: 0, err: err}
		}
		return emitter.rows, nil
	}
	for _, r := range work {
		err := pr.call(ctx, func(ctx context.Context) error {
			return pr.fn.Handler(ctx, tx, r, &Events{emit: emitter.emit, rec: r})
		})
		if err == nil {
			err = emitter.err
		}
		if err != nil {
			return nil, &handlerFailure{index: indexIn(r), err: err}
		}
	}
	return emitter.rows, nil
}

// call runs a handler with the handler timeout and turns a panic into an error.
func (pr *partitionRun) call(ctx context.Context, handler func(context.Context) error) (err error) {
	ctx, cancel := context.WithTimeout(ctx, pr.w.cfg.HandlerTimeout)
	defer cancel()
	defer func() {
		if v := recover(); v != nil {
			err = &panicError{value: v, stack: debug.Stack()}
		}
	}()
	err = handler(ctx)
	if err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		err = &timeoutError{limit: pr.w.cfg.HandlerTimeout, err: err}
	}
	return err
}

// deadLetter parks rec in its own transaction and moves the cursor past it.
func (pr *partitionRun) deadLetter(ctx context.Context, rec Record, cause error, attempts int) error {
	tx, err := pr.w.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin dead-letter transaction on %s: %w", pr.part, err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit
	if err := inbox.Advance(ctx, tx, pr.part, pr.token, pr.next, rec.Offset+1); err != nil {
		return err
	}
	if err := pr.writeDeadLetter(ctx, tx, rec, failureReason(cause), cause, attempts); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit dead letter %s@%d: %w", pr.part, rec.Offset, err)
	}
	pr.committed(rec.Offset+1, 0, 0, 1)
	pr.log.Warn("record dead-lettered", "offset", rec.Offset, "reason", failureReason(cause), "attempts", attempts, "err", firstLine(cause))
	return nil
}

func (pr *partitionRun) writeDeadLetter(ctx context.Context, tx pgx.Tx, rec Record, reason string, cause error, attempts int) error {
	headers := make([]inbox.Header, len(rec.Headers))
	for i, h := range rec.Headers {
		headers[i] = inbox.Header{Key: h.Key, Value: h.Value}
	}
	return inbox.WriteDeadLetter(ctx, tx, pr.token, inbox.DeadLetter{
		Partition: pr.part, Offset: rec.Offset, Key: rec.Key, Value: rec.Value, Headers: headers,
		RecordTime: rec.Time, Reason: reason, Error: cause.Error(), Attempts: attempts,
	})
}

// committed moves the in-memory cursor after a successful commit.
func (pr *partitionRun) committed(next int64, applied, duplicates, deadLettered int) {
	pr.next = next
	pr.highWater = max(pr.highWater, next)
	st := pr.w.stats
	st.Applied.Add(int64(applied))
	st.Duplicates.Add(int64(duplicates))
	st.DeadLettered.Add(int64(deadLettered))
	st.Batches.Add(1)
	st.update(pr.fn.Name, pr.part.Topic, pr.part.Partition, func(p *PartitionStats) {
		p.NextOffset = next
		p.LastCommit = time.Now()
	})
	pr.w.offsets.note(pr.fn.Name, pr.part.Topic, pr.part.Partition, next)
}

func failureReason(err error) string {
	var p *panicError
	var t *timeoutError
	switch {
	case errors.As(err, &p):
		return "panic"
	case errors.As(err, &t):
		return "timeout"
	case IsPermanent(err):
		return "permanent"
	default:
		return "handler_error"
	}
}

type panicError struct {
	value any
	stack []byte
}

func (e *panicError) Error() string { return fmt.Sprintf("handler panicked: %v\n%s", e.value, e.stack) }

type timeoutError struct {
	limit time.Duration
	err   error
}

func (e *timeoutError) Error() string {
	return fmt.Sprintf("handler ran over its %s timeout (--handler-timeout): %v", e.limit, e.err)
}
func (e *timeoutError) Unwrap() error { return e.err }

// firstLine keeps log lines short: a panic's stack goes to the dead letter,
// not to the log.
func firstLine(err error) string {
	line, _, _ := strings.Cut(err.Error(), "\n")
	return line
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
