package operator

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/inbox"
)

// RetryRequest asks to run dead letters through their function again: the
// letters of Function (narrowed by Topic, Partition and DeadReason when
// set), or exactly the letters IDs.
type RetryRequest struct {
	Function   string
	Topic      string
	Partition  int32 // -1: every partition
	DeadReason string
	IDs        []int64
	Limit      int    // at most this many letters; default 1000
	Reason     string // required, for the audit log
	Actor      string
}

// Retry marks the selected dead letters for retry, audited, in one
// transaction, and notifies the workers. It runs no handler: the worker
// lane that owns each letter's partition (or subject) applies it, in offset
// order, under its own fence, deleting the letter in the transaction that
// applies it, so a letter is applied once however often it is retried (see
// inbox.MarkForRetry). Letters that cannot be retried from their dead
// letter (oversized, or parked without their bytes) are refused.
func Retry(ctx context.Context, pool *pgxpool.Pool, req RetryRequest) (inbox.RetryMarks, error) {
	var res inbox.RetryMarks
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
		res, err = inbox.MarkForRetry(ctx, tx, inbox.RetryRequest{
			RetrySelection: inbox.RetrySelection{
				Function: req.Function, Topic: req.Topic, Partition: req.Partition, DeadReason: req.DeadReason,
				IDs: req.IDs, Limit: req.Limit,
			},
			Actor: req.Actor, Reason: req.Reason,
		})
		return err
	})
	return res, err
}

// WaitRetries waits until every letter marked by a Retry is applied or has
// failed again, or until timeout, looking every poll, and returns their
// outcomes in the order they were marked (RetryPending for those still
// waiting at the timeout). It returns early with ctx's error when ctx ends.
func WaitRetries(ctx context.Context, pool *pgxpool.Pool, marks inbox.RetryMarks, timeout, poll time.Duration) ([]inbox.RetryOutcome, error) {
	ids := make([]int64, len(marks.Marked))
	for i, m := range marks.Marked {
		ids[i] = m.ID
	}
	deadline := time.Now().Add(timeout)
	for {
		found, err := inbox.RetryOutcomes(ctx, pool, marks.AuditMark, ids)
		if err != nil {
			return nil, err
		}
		out := make([]inbox.RetryOutcome, len(ids))
		pending := false
		for i, id := range ids {
			out[i] = found[id]
			pending = pending || out[i].Outcome == inbox.RetryPending
		}
		if !pending || time.Now().After(deadline) {
			return out, nil
		}
		t := time.NewTimer(poll)
		select {
		case <-ctx.Done():
			t.Stop()
			return out, ctx.Err()
		case <-t.C:
		}
	}
}
