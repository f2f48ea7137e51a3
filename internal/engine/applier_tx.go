package engine

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/outbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// This file holds the round trips of a batch transaction that are kfn's,
// not the handler's: one to begin it, fence the lane and claim the records
// (pgx.Batch.BeginTx with the claim queued behind the BEGIN), and one to
// write the outbox rows and commit (the INSERT and the COMMIT pipelined:
// Postgres skips the COMMIT when the INSERT fails, so nothing commits
// unless everything succeeded). Stats.BatchRoundTrips counts every round
// trip made for a batch transaction, the handler's included.

// begin starts a transaction on a connection of its own.
func (a *applier) begin(ctx context.Context) (*txConn, pgx.Tx, error) {
	conn, tx, _, err := a.beginClaim(ctx, nil)
	return conn, tx, err
}

// beginClaim starts a batch transaction on a connection of its own and, when
// recs is not empty, queues the claim of recs behind its BEGIN if the
// lane's tracker can (batchClaimer). The returned claim function returns
// the fresh records of recs once the transaction is open: from the queued
// claim, or by claiming them then.
func (a *applier) beginClaim(ctx context.Context, recs []kfn.Record) (*txConn, pgx.Tx, func(context.Context, pgx.Tx) ([]kfn.Record, error), error) {
	conn, err := acquireTxConn(ctx, a.pool)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("begin transaction on %s: %w", a.part, err)
	}
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	claim := func(ctx context.Context, tx pgx.Tx) ([]kfn.Record, error) { return a.tracker.claim(ctx, tx, recs) }
	if q, ok := a.tracker.(batchClaimer); ok && len(recs) > 0 {
		claim = q.queueClaim(b, recs)
	}
	br := conn.pooled.SendBatch(ctx, b)
	tx := br.Tx()
	if err := br.Close(); err != nil {
		tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // the session may be gone; Release then drops it
		conn.pooled.Release()
		if b.Len() > 1 {
			return nil, nil, nil, fmt.Errorf("begin transaction on %s with its fence and inbox claim: %w", a.part, err)
		}
		return nil, nil, nil, fmt.Errorf("begin transaction on %s: %w", a.part, err)
	}
	return conn, tx, claim, nil
}

// commitWithOutbox writes rows to the outbox (as mode says) and commits tx, in one round
// trip. It returns what failed ("write the outbox rows" or "commit") with
// the error; after an error the transaction may still be open, for the
// caller to roll back. A COMMIT that Postgres answers with ROLLBACK (the
// transaction had failed) is pgx.ErrTxCommitRollback, as with tx.Commit.
func commitWithOutbox(ctx context.Context, tx pgx.Tx, mode outbox.Mode, rows []outbox.Row) (string, error) {
	b := &pgx.Batch{}
	outbox.QueueWrite(b, mode, rows)
	b.Queue("COMMIT")
	br := tx.SendBatch(ctx, b)
	defer br.Close()
	if len(rows) > 0 {
		if _, err := br.Exec(); err != nil {
			return "write the outbox rows", fmt.Errorf("write %d outbox events (%s): %w", len(rows), mode, err)
		}
	}
	tag, err := br.Exec()
	if err == nil && tag.String() == "ROLLBACK" {
		err = pgx.ErrTxCommitRollback
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "commit", err
	}
	return "", nil
}

// outboxMode is where cfg's functions write their events (--outbox); the
// setting's check has accepted it.
func outboxMode(cfg *kfn.Config) outbox.Mode {
	mode, _ := outbox.ParseMode(cfg.Outbox)
	return mode
}
