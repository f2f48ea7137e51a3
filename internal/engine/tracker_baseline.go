package engine

import (
	"context"

	"github.com/jackc/pgx/v5"

	kfn "github.com/kfn-dev/kfn/runtime"
)

// atLeastOnce is the benchmark's baseline tracker: the same batching and
// transactions, but no inbox claim and no fenced cursor move, so the
// difference to exactly-once is what those cost. The cursor only moves in
// memory (and to Kafka's group offsets).
func atLeastOnce(cursor *partitionTracker) cursorLane { return atLeastOnceTracker{cursor} }

type atLeastOnceTracker struct{ cursor *partitionTracker }

func (l atLeastOnceTracker) claim(_ context.Context, _ pgx.Tx, recs []kfn.Record) ([]kfn.Record, error) {
	return recs, nil
}
func (atLeastOnceTracker) fence(context.Context, pgx.Tx, kfn.Record) error            { return nil }
func (atLeastOnceTracker) markDeadLettered(context.Context, pgx.Tx, kfn.Record) error { return nil }
func (l atLeastOnceTracker) committed(last kfn.Record)                                { l.cursor.committed(last) }
func (l atLeastOnceTracker) cursorAfter(rec kfn.Record) int64                         { return l.cursor.cursorAfter(rec) }
func (atLeastOnceTracker) pass(context.Context, pgx.Tx, int64) error                  { return nil }
func (l atLeastOnceTracker) passed(to int64)                                          { l.cursor.passed(to) }
