package engine

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/faults"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// keyLaneTracker fences a key-lane's transactions by its row in
// kfn.key_lanes under the partition's token, and claims its records in the
// partition's offset inbox.
type keyLaneTracker struct {
	lane *keyLane
}

func (t *keyLaneTracker) part() inbox.Partition { return t.lane.part }

func (t *keyLaneTracker) fence(ctx context.Context, tx pgx.Tx, rec kfn.Record) error {
	faults.Lane(faults.BeforeFence, t.part(), t.lane.token)
	return t.fenced(inbox.FenceKeyLane(ctx, tx, t.part(), t.lane.index, t.lane.token, rec.Offset+1))
}

func (t *keyLaneTracker) fenced(err error) error {
	switch {
	case err == nil:
		faults.Lane(faults.AfterFence, t.part(), t.lane.token)
	case errors.Is(err, inbox.ErrFenced):
		faults.Lane(faults.FenceRefused, t.part(), t.lane.token)
	}
	return err
}

func (t *keyLaneTracker) claim(ctx context.Context, tx pgx.Tx, recs []kfn.Record) ([]kfn.Record, error) {
	b := &pgx.Batch{}
	result := t.queueClaim(b, recs)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, err
	}
	return result(ctx, tx)
}

// queueClaim fences the key-lane and claims recs in the inbox in one
// statement. Offsets below the high-water mark at the claim were handled
// before.
func (t *keyLaneTracker) queueClaim(b *pgx.Batch, recs []kfn.Record) func(context.Context, pgx.Tx) ([]kfn.Record, error) {
	candidates := make([]int64, 0, len(recs))
	for _, r := range recs {
		if r.Offset >= t.lane.set.highWater {
			candidates = append(candidates, r.Offset)
		}
	}
	faults.Lane(faults.BeforeFence, t.part(), t.lane.token)
	result := inbox.QueueFenceKeyLaneAndClaim(b, t.part(), t.lane.index, t.lane.token, recs[len(recs)-1].Offset+1, candidates)
	return func(ctx context.Context, tx pgx.Tx) ([]kfn.Record, error) {
		freshOffsets, err := result(ctx, tx)
		if err := t.fenced(err); err != nil {
			return nil, err
		}
		return freshRecords(recs, freshOffsets), nil
	}
}

// freshRecords returns the records of recs whose offsets are in fresh
// (ascending), in order.
func freshRecords(recs []kfn.Record, fresh []int64) []kfn.Record {
	if len(fresh) == len(recs) { // the usual batch: every record is new
		return recs
	}
	isFresh := make(map[int64]bool, len(fresh))
	for _, o := range fresh {
		isFresh[o] = true
	}
	out := make([]kfn.Record, 0, len(fresh))
	for _, r := range recs {
		if isFresh[r.Offset] {
			out = append(out, r)
		}
	}
	return out
}

func (t *keyLaneTracker) markDeadLettered(ctx context.Context, tx pgx.Tx, rec kfn.Record) error {
	return inbox.MarkDeadLettered(ctx, tx, t.part(), t.lane.token, rec.Offset)
}

func (t *keyLaneTracker) committed(last kfn.Record) { t.lane.set.committed(t.lane, last.Offset) }

// cursorAfter is the partition's cursor: a key-lane's commit moves only the
// cursor's target, and the cursor mover the cursor.
func (t *keyLaneTracker) cursorAfter(kfn.Record) int64 { return t.lane.set.next() }
