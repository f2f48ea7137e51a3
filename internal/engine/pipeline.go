package engine

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// pipelinedTx is the transaction a Handler gets when its Function sets
// PipelineExecs. Exec queues the statement and returns at once (an empty
// command tag, no error); the queue goes to Postgres in one round trip (a
// pgx.Batch) before any other statement of a handler, so that a Query sees
// every earlier write, and after the batch's last record. A queued
// statement that fails is charged to the record whose handler queued it.
//
// It is opt-in because it changes what Exec promises: its command tag
// (RowsAffected) is empty and its error comes later, charged to the record
// but not returned to the handler. LargeObjects and Conn bypass the queue.
type pipelinedTx struct {
	pgx.Tx
	queue  *pgx.Batch
	owners []int // for each queued statement, the index of the record that queued it
	record int   // the index of the record whose handler runs now
	// failed is the first failure of a flush a handler's own statement
	// caused, charged to the record that queued the failing statement.
	failed *handlerFailure
}

func newPipelinedTx(tx pgx.Tx) *pipelinedTx { return &pipelinedTx{Tx: tx, queue: &pgx.Batch{}} }

// Exec queues sql; it runs at the next flush.
func (t *pipelinedTx) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	t.queue.Queue(sql, args...)
	t.owners = append(t.owners, t.record)
	return pgconn.CommandTag{}, nil
}

// flush sends the queued statements in one round trip. A failure is
// remembered in t.failed, charged to the record that queued the failing
// statement, and returned.
func (t *pipelinedTx) flush(ctx context.Context) error {
	if t.failed != nil {
		return t.failed.err // the transaction is aborted
	}
	if t.queue.Len() == 0 {
		return nil
	}
	b, owners := t.queue, t.owners
	t.queue, t.owners = &pgx.Batch{}, nil
	br := t.Tx.SendBatch(ctx, b)
	for _, owner := range owners {
		if _, err := br.Exec(); err != nil {
			br.Close() //nolint:errcheck // the error is err's
			t.failed = &handlerFailure{index: owner, err: err}
			return err
		}
	}
	if err := br.Close(); err != nil {
		t.failed = &handlerFailure{index: owners[len(owners)-1], err: err}
		return err
	}
	return nil
}

func (t *pipelinedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.flush(ctx); err != nil {
		return nil, err
	}
	return t.Tx.Query(ctx, sql, args...)
}

func (t *pipelinedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := t.flush(ctx); err != nil {
		return errRow{err}
	}
	return t.Tx.QueryRow(ctx, sql, args...)
}

func (t *pipelinedTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.flush(ctx); err != nil {
		return 0, err
	}
	return t.Tx.CopyFrom(ctx, table, columns, src)
}

func (t *pipelinedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if err := t.flush(ctx); err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return t.Tx.SendBatch(ctx, b)
}

func (t *pipelinedTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.flush(ctx); err != nil {
		return nil, err
	}
	return t.Tx.Prepare(ctx, name, sql)
}

// Begin starts a savepoint once the queue is sent. Statements on the
// savepoint run at once.
func (t *pipelinedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.flush(ctx); err != nil {
		return nil, err
	}
	return t.Tx.Begin(ctx)
}

// errRow is a pgx.Row whose Scan fails with err.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
