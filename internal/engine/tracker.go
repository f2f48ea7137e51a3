package engine

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/faults"
	"github.com/kfn-dev/kfn/internal/observe"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// tracker is how a lane fences its commits and remembers what it handled.
// A Kafka partition keeps a cursor and an offset inbox; a JetStream subject
// keeps an event-id inbox.
type tracker interface {
	// claim fences tx for recs and claims them in the inbox, returning the
	// records that were not handled before, in order.
	claim(ctx context.Context, tx pgx.Tx, recs []kfn.Record) ([]kfn.Record, error)
	// fence fences tx for moving the lane past rec without claiming it.
	fence(ctx context.Context, tx pgx.Tx, rec kfn.Record) error
	// markDeadLettered records rec in the inbox as dead-lettered.
	markDeadLettered(ctx context.Context, tx pgx.Tx, rec kfn.Record) error
	// committed moves the in-memory position past last after a commit.
	committed(last kfn.Record)
	// cursorAfter is the lane's position once rec is committed.
	cursorAfter(rec kfn.Record) int64
}

// partitionTracker keeps a Kafka partition's cursor: the next offset, moved
// in every transaction under the fencing token, and the high-water mark
// below which every offset was handled before.
type partitionTracker struct {
	stats     *observe.Stats
	onCommit  func(next int64) // after each commit, with the new cursor (Kafka's group offsets mirror it)
	part      inbox.Partition
	token     int64
	next      int64
	highWater int64
	// afters holds, for the records of the batch being applied that are
	// followed by offsets without a committed record (transaction markers,
	// aborted records), where the cursor goes once each is applied: past
	// those offsets. The batch's fetch found them (partitionRun.fetch).
	afters map[int64]int64
}

// cursorAfter is where the cursor goes once rec is applied or
// dead-lettered: the offset after it, or past the offsets after it that
// hold no committed record, up to the next record the reader found.
func (l *partitionTracker) cursorAfter(rec kfn.Record) int64 {
	return max(rec.Offset+1, l.afters[rec.Offset])
}

// errCursorAhead means the cursor is past where this lane thought it was,
// under this lane's own token: an earlier commit of ours landed although its
// reply was lost (the connection died at COMMIT). The in-memory cursor has
// been reloaded; retrying skips what that commit applied.
var errCursorAhead = errors.New("cursor is ahead of the lane: an earlier commit landed without its reply; resuming from the stored cursor")

func (l *partitionTracker) fence(ctx context.Context, tx pgx.Tx, rec kfn.Record) error {
	faults.Lane(faults.BeforeFence, l.part, l.token)
	return l.fenced(inbox.Advance(ctx, tx, l.part, l.token, l.next, l.cursorAfter(rec)))
}

// pass moves the cursor in tx to `to` over offsets that hold no committed
// record (transaction markers, aborted transactions' records), claiming no
// inbox row: fenced like every commit, so a zombie's pass is refused.
func (l *partitionTracker) pass(ctx context.Context, tx pgx.Tx, to int64) error {
	faults.Lane(faults.BeforeFence, l.part, l.token)
	return l.fenced(inbox.Advance(ctx, tx, l.part, l.token, l.next, to))
}

// passed moves the in-memory cursor to `to` after pass committed.
func (l *partitionTracker) passed(to int64) {
	l.next = max(l.next, to)
	l.highWater = max(l.highWater, l.next)
	l.onCommit(l.next)
}

// fenced handles the outcome of a fenced cursor update: a cursor ahead of
// the lane (an earlier commit of ours landed without its reply) reloads
// the lane's position and is errCursorAhead.
func (l *partitionTracker) fenced(err error) error {
	var moved *inbox.CursorMovedError
	switch {
	case err == nil:
		faults.Lane(faults.AfterFence, l.part, l.token)
		return nil
	case errors.Is(err, inbox.ErrFenced):
		faults.Lane(faults.FenceRefused, l.part, l.token)
		return err
	case errors.As(err, &moved):
		l.next, l.highWater = moved.Cursor.NextOffset, moved.Cursor.HighWater
		l.stats.CommitRepliesLost.Add(1)
		l.stats.CountFn(l.part.Consumer, func(c *observe.FunctionCounters) { c.CommitRepliesLost++ })
		return errCursorAhead
	default:
		return err
	}
}

// batchClaimer is a tracker whose claim can ride on the batch that begins
// the transaction (pgx.Batch.BeginTx): begin, fence and claim in one round
// trip.
type batchClaimer interface {
	// queueClaim queues the claim of recs on b; once b is sent and closed,
	// the returned function, given b's transaction, returns what claim
	// returns.
	queueClaim(b *pgx.Batch, recs []kfn.Record) func(context.Context, pgx.Tx) ([]kfn.Record, error)
}

func (l *partitionTracker) claim(ctx context.Context, tx pgx.Tx, recs []kfn.Record) ([]kfn.Record, error) {
	b := &pgx.Batch{}
	result := l.queueClaim(b, recs)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, err
	}
	return result(ctx, tx)
}

// queueClaim fences and claims recs in the inbox in one statement (the
// cursor's move and the inbox rows commit together or not at all).
func (l *partitionTracker) queueClaim(b *pgx.Batch, recs []kfn.Record) func(context.Context, pgx.Tx) ([]kfn.Record, error) {
	// Offsets below the high-water mark were handled before (their inbox
	// rows may be purged since); the inbox claim catches the rest.
	candidates := make([]int64, 0, len(recs))
	for _, r := range recs {
		if r.Offset >= l.highWater {
			candidates = append(candidates, r.Offset)
		}
	}
	faults.Lane(faults.BeforeFence, l.part, l.token)
	result := inbox.QueueFenceAndClaim(b, l.part, l.token, l.next, l.cursorAfter(recs[len(recs)-1]), candidates)
	return func(ctx context.Context, tx pgx.Tx) ([]kfn.Record, error) {
		freshOffsets, err := result(ctx, tx)
		if err := l.fenced(err); err != nil {
			return nil, err
		}
		return freshRecords(recs, freshOffsets), nil
	}
}

func (l *partitionTracker) markDeadLettered(ctx context.Context, tx pgx.Tx, rec kfn.Record) error {
	return inbox.MarkDeadLettered(ctx, tx, l.part, l.token, rec.Offset)
}

func (l *partitionTracker) committed(last kfn.Record) { l.passed(l.cursorAfter(last)) }
