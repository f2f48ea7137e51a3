package engine

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/observe"
	"github.com/kfn-dev/kfn/internal/pgdata"
	"github.com/kfn-dev/kfn/internal/repeatlog"
	"github.com/kfn-dev/kfn/outbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// applier applies the records of one lane (a Kafka partition, or a JetStream
// subject) through the function's handler: batched transactions, the prefix
// before a failing record committed, the failing record retried alone with
// backoff and then dead-lettered. The tracker says how the lane fences its
// commits and remembers handled records.
type applier struct {
	pool       *pgxpool.Pool
	cfg        *kfn.Config
	stats      *observe.Stats
	fn         kfn.Function
	part       inbox.Partition
	token      int64
	generation int // re-executions of the lane so far; part of event ids
	tracker    tracker
	log        *slog.Logger
	repeats    *repeatlog.Log // the worker's: retried failures, logged once per step (retryInfra)
	tracer     trace.Tracer   // spans of batches and handler calls (applier_trace.go); nil while tracing is off
	start      *startClock    // the worker's start, which its first commit logs
	// held is the lane's view of its partition's parked keys, for a
	// function with KeyOrder ParkKey (applier_parkkey.go); nil otherwise.
	held *heldKeys
	// wakeRetries makes the lane look for dead letters to retry before its
	// next batch; nil when it does not retry.
	wakeRetries func()
	// atStop is the batch transaction that was in flight when the lane's
	// ctx ended, if one was.
	atStop batchAtStop
}

// batchAtStop is what a lane's batch in flight did once the lane was
// asked to stop (shutdown, rebalance, lease lost): committed if its COMMIT
// had been sent (the lane waits for the reply), else rolled back, so the
// next owner applies its records.
type batchAtStop struct {
	records int
	outcome string // "committed" or "rolled back"
}

// handlerFailure is a record whose handler failed; the transaction it ran in
// was rolled back.
type handlerFailure struct {
	// index is the position of the failing record in the slice passed to
	// commit, or unknownCulprit.
	index int
	err   error
}

// unknownCulprit is the index of a failure that one of several records
// caused, kfn cannot tell which (a failing BatchHandler, a data error at
// commit): those records then go on one per transaction.
const unknownCulprit = -1

// apply commits recs (in lane order) in as few transactions as it can. When
// a handler fails, the records before it are committed, the failing record
// is retried alone with backoff and then dead-lettered, and the rest goes
// on. When the culprit of a failed batch is unknown, that batch's records
// go on one per transaction. A record's failure costs it one handler call
// in the batch, then only its retries. It returns how many records were
// committed; an error returned is an infrastructure error or an
// *inbox.FencedError.
func (a *applier) apply(ctx context.Context, recs []kfn.Record) (done int, err error) {
	defer func() {
		if err != nil && !errors.Is(err, inbox.ErrFenced) && ctx.Err() == nil {
			a.stats.InfraRetries.Add(1) // the lane retries the batch (retryInfra)
			a.stats.CountFn(a.fn.Name, func(c *observe.FunctionCounters) { c.InfraRetries++ })
		}
	}()
	singly := 0       // how many of the next records go one per transaction
	prefix := 0       // how many of the next records to commit before culprit's record
	var culprit error // the failure of the record right after the prefix
	for len(recs) > 0 {
		if prefix == 0 && culprit != nil {
			if err := a.retryAlone(ctx, recs[0], culprit); err != nil {
				return done, err
			}
			recs, done, culprit, singly = recs[1:], done+1, nil, max(singly-1, 0)
			continue
		}
		n := len(recs)
		if singly > 0 {
			n = 1
		}
		if prefix > 0 {
			n = min(n, prefix)
		}
		failure, err := a.commit(ctx, recs[:n], 1)
		if err != nil {
			return done, err
		}
		switch {
		case failure == nil:
			recs, done, singly, prefix = recs[n:], done+n, max(singly-n, 0), prefix-min(prefix, n)
		case failure.index == unknownCulprit:
			singly = n
		default:
			prefix, culprit = failure.index, failure.err
		}
	}
	return done, nil
}

// retryAlone retries one record in its own transactions with exponential
// backoff until it commits, fails permanently or runs out of attempts; then
// it dead-letters it. A handler that overran --handler-timeout is not
// retried: another attempt would hold the lane for another whole timeout
// (and, if it ignores its ctx, leave another goroutine running).
func (a *applier) retryAlone(ctx context.Context, rec kfn.Record, firstErr error) error {
	cfg := a.cfg
	policy := backoff.NewExponentialBackOff()
	policy.InitialInterval = cfg.RetryInitial
	policy.MaxInterval = cfg.RetryMax
	policy.MaxElapsedTime = 0
	policy.Reset()

	lastErr, attempt := firstErr, 1
	for attempt < cfg.RetryAttempts && Retryable(lastErr) {
		a.log.Warn("handler failed, retrying", "offset", rec.Offset, "attempt", attempt, "err", observe.FirstLine(lastErr))
		if err := sleep(ctx, policy.NextBackOff()); err != nil {
			return err
		}
		attempt++
		a.stats.Retries.Add(1)
		a.stats.CountFn(a.fn.Name, func(c *observe.FunctionCounters) { c.Retries++ })
		failure, err := a.commit(ctx, []kfn.Record{rec}, attempt)
		if err != nil {
			return err
		}
		if failure == nil {
			return nil
		}
		lastErr = failure.err
	}
	return a.deadLetter(ctx, rec, lastErr, attempt)
}

// commit tries to apply recs in one transaction. It returns a handlerFailure
// (transaction rolled back, nothing applied) when a handler fails.
func (a *applier) commit(ctx context.Context, recs []kfn.Record, attempt int) (failure *handlerFailure, err error) {
	ctx, span := a.startBatch(ctx, recs, attempt)
	defer func() {
		status := err
		if failure != nil {
			status = failure.err
		}
		observe.EndSpan(span, status)
	}()
	began := time.Now()
	abandoned, committed := false, false
	defer func() {
		if ctx.Err() != nil {
			a.atStop = batchAtStop{records: len(recs), outcome: "rolled back"}
			if committed {
				a.atStop.outcome = "committed"
			}
		}
	}()
	ctx = observe.CountRoundTrips(ctx, &a.stats.BatchRoundTrips)
	conn, tx, claim, err := a.beginClaim(ctx, recs)
	if err != nil {
		return nil, err
	}
	defer func() {
		if abandoned {
			return // the abandoned handler's goroutine still holds tx; its connection is out of the pool
		}
		if !committed { // the pipelined COMMIT leaves pgx's tx open, the session idle
			tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // the transaction may have ended already
		}
		conn.pooled.Release()
	}()

	fresh, err := claim(ctx, tx)
	if err != nil {
		return nil, err
	}
	duplicates := len(recs) - len(fresh)

	held, checked, err := a.checkHeld(ctx, tx, fresh)
	if err != nil {
		return nil, err
	}
	work, dead := a.selectWork(fresh, attempt, held)
	var parked, marked []int64
	for _, d := range dead {
		if err := a.writeDeadLetter(ctx, tx, d.rec, d.reason, d.err, 0); err != nil {
			return nil, err
		}
		switch {
		case d.reason == inbox.ReasonKeyParked:
			parked = append(parked, d.rec.Offset)
			if d.marked {
				marked = append(marked, d.rec.Offset)
			}
		default: // oversized
			if err := a.parkKey(ctx, tx, d.rec, held); err != nil {
				return nil, err
			}
		}
	}
	if err := inbox.MarkParkedForRetry(ctx, tx, a.part, marked, a.cfg.WorkerID); err != nil {
		return nil, err
	}

	rows, rejected, emitted, failure := a.runHandlers(ctx, conn, tx, work, recs, true)
	if failure != nil {
		abandoned = isAbandoned(failure.err)
		if ctx.Err() != nil || (!isHandlerTimeout(failure.err) && tx.Conn().IsClosed()) {
			return nil, fmt.Errorf("transaction on %s broke during the handler: %w", a.part, failure.err)
		}
		return failure, nil
	}
	for _, r := range rejected {
		if err := a.writeDeadLetter(ctx, tx, r.Record, failureReason(r.Err), r.Err, attempt); err != nil {
			if failure := recordsFault(recs, "write a rejected record's dead letter", err); failure != nil {
				return failure, nil
			}
			return nil, err
		}
		dead = append(dead, deadRecord{rec: r.Record, reason: failureReason(r.Err), err: r.Err})
	}
	// The outbox rows and the COMMIT go in one round trip. Once COMMIT is
	// sent, wait for its reply even if the lane is being stopped (shutdown,
	// lease lost): otherwise a commit that lands would be counted nowhere.
	// The wait stays bounded by the round-trip limit, and the fence makes a
	// late commit safe: it was serialised in Postgres.
	if what, err := commitWithOutbox(context.WithoutCancel(ctx), tx, outboxMode(a.cfg), rows); err != nil {
		if failure := recordsFault(recs, what, err); failure != nil { // a data error in the outbox rows, a deferred constraint the records' writes broke
			return failure, nil
		}
		if what == "commit" {
			return nil, fmt.Errorf("commit %d records of %s: %w", len(recs), a.part, err)
		}
		return nil, err
	}
	committed = true

	deadReasons := make([]string, len(dead))
	for i, d := range dead {
		deadReasons[i] = d.reason
	}
	a.committed(recs[len(recs)-1], len(work)-len(rejected), duplicates, deadReasons...)
	a.stats.ObserveCommit(a.fn.Name, len(recs), withoutRejected(work, rejected), began)
	a.start.committed(a.log, began)
	a.stats.TraceContextDropped.Add(int64(emitted.traceDropped))
	a.stats.CountFn(a.fn.Name, func(c *observe.FunctionCounters) { c.TraceContextDropped += int64(emitted.traceDropped) })
	for _, d := range dead {
		if d.reason != inbox.ReasonKeyParked {
			a.log.Warn("record dead-lettered", "offset", d.rec.Offset, "reason", d.reason, "bytes", recordSize(d.rec))
		}
	}
	a.keysChecked(held, checked, parked, marked)
	return nil, nil
}

// keysChecked updates the lane's held keys after a batch's commit: the keys
// the database said are free are dropped, and the records parked are
// counted (those marked for retry behind their released key wake the
// lane's retries).
func (a *applier) keysChecked(held map[string]inbox.HeldKey, checked []string, parked, marked []int64) {
	if a.held == nil {
		return
	}
	var free []string
	for _, k := range checked {
		if _, ok := held[k]; !ok {
			free = append(free, k)
		}
	}
	a.held.drop(free)
	if len(parked) > 0 {
		a.stats.KeyParked.Add(int64(len(parked)))
		a.stats.CountFn(a.fn.Name, func(c *observe.FunctionCounters) { c.KeyParked += int64(len(parked)) })
		a.log.Warn("records parked behind an earlier dead letter of their key", "reason", inbox.ReasonKeyParked,
			"count", len(parked), "first_offset", parked[0], "marked_for_retry", len(marked))
	}
	if len(marked) > 0 && a.wakeRetries != nil {
		a.wakeRetries()
	}
}

// dataError is a Postgres data error (pgdata.IsDataError) raised by kfn's own
// write of records' data: the records' fault, not the infrastructure's.
type dataError struct {
	what string
	err  error
}

func (e *dataError) Error() string {
	return fmt.Sprintf("Postgres refused the record's data when kfn tried to %s: %v", e.what, e.err)
}
func (e *dataError) Unwrap() error { return e.err }

// swallowedError is a transaction a handler left aborted: one of its
// statements failed (say, text with a NUL byte copied from the record) and
// the handler returned nil instead of the error, so kfn's next statement or
// the commit fails.
type swallowedError struct {
	what string
	err  error
}

func (e *swallowedError) Error() string {
	return fmt.Sprintf("kfn could not %s: a statement of the handler failed and the handler did not return its error: %v", e.what, e.err)
}
func (e *swallowedError) Unwrap() error { return e.err }

// recordsFault returns the handler failure that charges err to the records
// of a transaction when err is their fault: a Postgres data error
// (pgdata.IsDataError) or a transaction the handler left aborted. Retrying
// the same transaction can never succeed, so it must not be retried as an
// infrastructure error. With several records the culprit is unknown: like a
// failing BatchHandler, the batch then goes on one record at a time from the
// first, so the culprit ends up retried alone and dead-lettered while the
// others commit. It returns nil for any other error.
func recordsFault(recs []kfn.Record, what string, err error) *handlerFailure {
	var pgErr *pgconn.PgError
	var cause error
	switch {
	case pgdata.IsDataError(err):
		cause = &dataError{what: what, err: err}
	case errors.Is(err, pgx.ErrTxCommitRollback), errors.As(err, &pgErr) && pgErr.Code == "25P02": // in_failed_sql_transaction
		cause = &swallowedError{what: what, err: err}
	default:
		return nil
	}
	failure := &handlerFailure{err: cause}
	if len(recs) > 1 {
		failure.index = unknownCulprit
	}
	return failure
}

// deadRecord is a record of a batch that no handler gets: too large, or
// parked behind an earlier dead letter of its key.
type deadRecord struct {
	rec    kfn.Record
	reason string // oversized or key_parked
	err    error
	marked bool // key_parked behind a released key: marked for retry, to follow its key's parked records
}

// selectWork splits the fresh records, in order, into those to hand to the
// handler and those no handler gets: a record whose key is held (held,
// from checkHeld; nil when the function does not park keys) is parked
// behind it, and a record too large to hand to anyone is dead-lettered.
// With ParkKey an oversized record blocks its key (held gets it), so its
// key's later records in the batch are parked behind it.
func (a *applier) selectWork(fresh []kfn.Record, attempt int, held map[string]inbox.HeldKey) (work []kfn.Record, dead []deadRecord) {
	for _, r := range fresh {
		if k, ok := parks(held, r); ok {
			dead = append(dead, deadRecord{rec: r, reason: inbox.ReasonKeyParked, err: keyParkedError(k), marked: k.Released})
			continue
		}
		if recordSize(r) > a.cfg.MaxRecordBytes {
			err := fmt.Errorf("record is %d bytes (key, value and headers), over the %d-byte limit (--max-record-bytes)", recordSize(r), a.cfg.MaxRecordBytes)
			dead = append(dead, deadRecord{rec: r, reason: "oversized", err: err})
			if held != nil && r.Key != nil {
				held[string(r.Key)] = inbox.HeldKey{Key: r.Key, Offset: r.Offset}
			}
			continue
		}
		r.Attempt = attempt
		work = append(work, r)
	}
	return work, dead
}

// recordSize is what --max-record-bytes limits: the key, the value and the
// name and value of every header.
func recordSize(r kfn.Record) int {
	n := len(r.Key) + len(r.Value)
	for _, h := range r.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return n
}

// runHandlers calls the function's handler on work inside tx and returns the
// outbox rows it emitted and the records a BatchHandler rejected (only when
// inline, for a function with KeyOrder Continue: the caller dead-letters
// them in tx; otherwise the first rejected record is the failure). On
// failure the index refers to recs.
func (a *applier) runHandlers(ctx context.Context, conn *txConn, tx pgx.Tx, work, recs []kfn.Record, inline bool) ([]outbox.Row, []kfn.Rejection, *emitCollector, *handlerFailure) {
	emitter := newEmitCollector(a.fn, a.generation)
	indexIn := func(r kfn.Record) int {
		for i := range recs {
			if recs[i].Offset == r.Offset {
				return i
			}
		}
		panic("record not in batch")
	}
	if a.fn.BatchHandler != nil {
		if len(work) == 0 {
			return nil, nil, emitter, nil
		}
		hctx, records, span := a.startBatchHandler(ctx, work, emitter)
		out := newBatchEvents(emitter.emit)
		err := a.call(hctx, conn, func(ctx context.Context) error {
			return a.fn.BatchHandler(ctx, tx, work, out)
		})
		if err == nil {
			err = emitter.err
		}
		for _, r := range records {
			observe.EndSpan(r, nil)
		}
		observe.EndSpan(span, err)
		if err != nil {
			if len(recs) > 1 {
				return nil, nil, nil, &handlerFailure{index: unknownCulprit, err: err}
			}
			return nil, nil, nil, &handlerFailure{index: 0, err: err}
		}
		rejected := out.Rejected()
		if len(rejected) > 0 && (!inline || a.fn.KeyOrder == kfn.ParkKey) {
			first := rejected[0]
			for _, r := range rejected[1:] {
				if r.Record.Offset < first.Record.Offset {
					first = r
				}
			}
			return nil, nil, nil, &handlerFailure{index: indexIn(first.Record), err: first.Err}
		}
		return dropRejected(emitter.rows, rejected), rejected, emitter, nil
	}
	htx := tx
	var pipelined *pipelinedTx
	if a.fn.PipelineExecs {
		pipelined = newPipelinedTx(tx)
		htx = pipelined
	}
	for _, r := range work {
		if pipelined != nil {
			pipelined.record = indexIn(r)
		}
		hctx, span := a.startHandler(ctx, r, emitter)
		err := a.call(hctx, conn, func(ctx context.Context) error {
			return a.fn.Handler(ctx, htx, r, newEvents(r, emitter.emit))
		})
		if pipelined != nil && pipelined.failed != nil {
			observe.EndSpan(span, pipelined.failed.err)
			return nil, nil, nil, pipelined.failed // an earlier record's statement, maybe
		}
		if err == nil {
			err = emitter.err
		}
		observe.EndSpan(span, err)
		if err != nil {
			return nil, nil, nil, &handlerFailure{index: indexIn(r), err: err}
		}
	}
	if pipelined != nil && pipelined.flush(ctx) != nil {
		return nil, nil, nil, pipelined.failed
	}
	return emitter.rows, nil, emitter, nil
}

// withoutRejected leaves the rejected records out of work.
func withoutRejected(work []kfn.Record, rejected []kfn.Rejection) []kfn.Record {
	if len(rejected) == 0 {
		return work
	}
	gone := make(map[int64]bool, len(rejected))
	for _, r := range rejected {
		gone[r.Record.Offset] = true
	}
	kept := make([]kfn.Record, 0, len(work)-len(rejected))
	for _, r := range work {
		if !gone[r.Offset] {
			kept = append(kept, r)
		}
	}
	return kept
}

// dropRejected leaves out the outbox rows emitted for rejected records.
func dropRejected(rows []outbox.Row, rejected []kfn.Rejection) []outbox.Row {
	if len(rejected) == 0 {
		return rows
	}
	gone := make(map[int64]bool, len(rejected))
	for _, r := range rejected {
		gone[r.Record.Offset] = true
	}
	kept := rows[:0]
	for _, r := range rows {
		if !gone[r.Origin.Offset] {
			kept = append(kept, r)
		}
	}
	return kept
}

// deadLetter parks rec in its own transaction and moves the lane past it.
func (a *applier) deadLetter(ctx context.Context, rec kfn.Record, cause error, attempts int) error {
	tx, err := a.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin dead-letter transaction on %s: %w", a.part, err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit
	if err := a.tracker.fence(ctx, tx, rec); err != nil {
		return err
	}
	if err := a.writeDeadLetter(ctx, tx, rec, failureReason(cause), cause, attempts); err != nil {
		return err
	}
	if err := a.parkKey(ctx, tx, rec, nil); err != nil {
		return err
	}
	if err := tx.Commit(context.WithoutCancel(ctx)); err != nil { // as in commit
		return fmt.Errorf("commit dead letter %s@%d: %w", a.part, rec.Offset, err)
	}
	a.committed(rec, 0, 0, failureReason(cause))
	a.log.Warn("record dead-lettered", "offset", rec.Offset, "reason", failureReason(cause), "attempts", attempts, "err", observe.FirstLine(cause))
	return nil
}

// deadLetterValuePrefix is how much of an oversized record's value its dead
// letter keeps, besides the value's full size and SHA-256.
const deadLetterValuePrefix = 4 << 10

// writeDeadLetter records rec as dead-lettered in the lane's inbox and
// parks it in kfn.dead_letters. The dead letter holds the record's bytes as
// they are (bounded as an oversized record's when rec is over
// --max-record-bytes, whatever the reason); if Postgres still refuses it
// with a data error, inbox stores the record as a raw blob instead, so the
// write commits whatever the record holds.
func (a *applier) writeDeadLetter(ctx context.Context, tx pgx.Tx, rec kfn.Record, reason string, cause error, attempts int) error {
	if err := a.tracker.markDeadLettered(ctx, tx, rec); err != nil {
		return err
	}
	d := inbox.DeadLetter{
		Partition: a.part, Offset: rec.Offset, Key: rec.Key, Value: rec.Value, Headers: inbox.HeadersOf(rec.Headers),
		RecordTime: rec.Time, Reason: reason, Error: cause.Error(), Attempts: attempts,
	}
	if reason == "oversized" || recordSize(rec) > a.cfg.MaxRecordBytes {
		boundOversized(&d, a.cfg.MaxRecordBytes)
	}
	raw, err := inbox.WriteDeadLetter(ctx, tx, d)
	if raw {
		a.log.Warn("dead letter stored as a raw blob: Postgres refused it column by column", "offset", rec.Offset, "reason", reason)
	}
	return err
}

// boundOversized keeps an oversized record's dead letter small: the value
// shrinks to its first deadLetterValuePrefix bytes plus its size and SHA-256;
// the key and headers stay unless they alone are over the limit.
func boundOversized(d *inbox.DeadLetter, limit int) {
	if len(d.Value) > deadLetterValuePrefix {
		sum := sha256.Sum256(d.Value)
		d.ValueSize, d.ValueSHA256 = int64(len(d.Value)), sum[:]
		d.Value = d.Value[:deadLetterValuePrefix]
	}
	headerBytes := 0
	for _, h := range d.Headers {
		headerBytes += len(h.Key) + len(h.Value)
	}
	if len(d.Key)+headerBytes > limit {
		d.Error += fmt.Sprintf("\n(kfn: the key and the %d headers alone are %d bytes: the headers are not kept", len(d.Headers), len(d.Key)+headerBytes)
		d.Headers = nil
		if len(d.Key) > limit {
			d.Error += fmt.Sprintf(", and the key is cut to its first %d of %d bytes", deadLetterValuePrefix, len(d.Key))
			d.Key = d.Key[:deadLetterValuePrefix]
		}
		d.Error += ")"
	}
}

// committed moves the lane past last after a successful commit.
// The dead letters, if any, are counted under reason.
func (a *applier) committed(last kfn.Record, applied, duplicates int, deadReasons ...string) {
	a.tracker.committed(last)
	st := a.stats
	st.Applied.Add(int64(applied))
	st.Duplicates.Add(int64(duplicates))
	st.DeadLettered.Add(int64(len(deadReasons)))
	st.Batches.Add(1)
	st.CountFn(a.fn.Name, func(c *observe.FunctionCounters) {
		c.Applied += int64(applied)
		c.Duplicates += int64(duplicates)
		c.Batches++
		for _, reason := range deadReasons {
			c.DeadLettered[reason]++
		}
	})
	st.Update(a.fn.Name, a.part.Topic, a.part.Partition, func(p *observe.PartitionStats) {
		p.NextOffset = a.tracker.cursorAfter(last)
		p.LastCommit = time.Now()
	})
}

func failureReason(err error) string {
	var p *panicError
	var d *dataError
	switch {
	case errors.As(err, &p):
		return "panic"
	case isHandlerTimeout(err):
		return "timeout"
	case errors.As(err, &d):
		return "data_error"
	case kfn.IsPermanent(err):
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

// isHandlerTimeout reports whether err is a handler call that overran
// --handler-timeout (whether it returned late or was abandoned), or a
// statement of the handler that Postgres cancelled after statement_timeout.
func isHandlerTimeout(err error) bool {
	var t *timeoutError
	return errors.As(err, &t) || isStatementTimeout(err)
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

// HandleRecord applies rec through fn's Handler (or its BatchHandler, with
// a batch of one) inside tx, the way a lane does but without the inbox, the
// fence or retries, and returns the outbox rows of the events it emitted
// (validated as the worker validates them) without writing them. A panic in
// the handler is returned as an error, and so is a rejection (Permanent).
// It is for the author's test helper and the benchmark's naive mode.
func HandleRecord(ctx context.Context, tx pgx.Tx, fn kfn.Function, rec kfn.Record) (rows []outbox.Row, err error) {
	if fn.Handler == nil && fn.BatchHandler == nil {
		return nil, fmt.Errorf("function %s has no Handler or BatchHandler", fn.Name)
	}
	defer func() {
		if v := recover(); v != nil {
			err = &panicError{value: v, stack: debug.Stack()}
		}
	}()
	if rec.Attempt == 0 {
		rec.Attempt = 1
	}
	emitter := newEmitCollector(fn, 0)
	if fn.BatchHandler != nil {
		out := newBatchEvents(emitter.emit)
		if err := fn.BatchHandler(ctx, tx, []kfn.Record{rec}, out); err != nil {
			return nil, err
		}
		if rejected := out.Rejected(); len(rejected) > 0 {
			return nil, rejected[0].Err
		}
		return emitter.rows, emitter.err
	}
	htx := tx
	var pipelined *pipelinedTx
	if fn.PipelineExecs {
		pipelined = newPipelinedTx(tx)
		htx = pipelined
	}
	if err := fn.Handler(ctx, htx, rec, newEvents(rec, emitter.emit)); err != nil {
		return nil, err
	}
	if pipelined != nil {
		if err := pipelined.flush(ctx); err != nil {
			return nil, err
		}
	}
	return emitter.rows, emitter.err
}

// Retryable reports whether a record whose handler failed with err is tried
// again: unless err is Permanent or a timeout (another attempt would hold
// the lane for another whole timeout).
func Retryable(err error) bool { return !kfn.IsPermanent(err) && !isHandlerTimeout(err) }

// FailureReason is the reason a record that failed with err is
// dead-lettered with: panic, timeout, data_error, permanent or
// handler_error.
func FailureReason(err error) string { return failureReason(err) }
