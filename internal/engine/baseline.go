package engine

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// atLeastOnce is the benchmark's baseline ledger: the same batching and
// transactions, but no inbox claim and no fenced cursor move, so the
// difference to exactly-once is what those cost. The cursor only moves in
// memory (and to Kafka's group offsets).
func atLeastOnce(cursor *partitionLedger) ledger { return atLeastOnceLedger{cursor} }

type atLeastOnceLedger struct{ cursor *partitionLedger }

func (l atLeastOnceLedger) claim(_ context.Context, _ pgx.Tx, recs []Record) ([]Record, error) {
	return recs, nil
}
func (atLeastOnceLedger) fence(context.Context, pgx.Tx, Record) error            { return nil }
func (atLeastOnceLedger) markDeadLettered(context.Context, pgx.Tx, Record) error { return nil }
func (l atLeastOnceLedger) committed(last Record)                                { l.cursor.committed(last) }

// NewAtLeastOnceWorker is NewWorker whose partition lanes use the
// atLeastOnce ledger: the benchmark's baseline, never a production mode.
func NewAtLeastOnceWorker(ctx context.Context, cfg Config, fns ...Function) (*Worker, error) {
	wk, err := NewWorker(ctx, cfg, fns...)
	if err != nil {
		return nil, err
	}
	wk.w.partitionLedger = atLeastOnce
	return wk, nil
}
