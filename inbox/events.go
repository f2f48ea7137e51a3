package inbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/internal/pgdata"
)

// EventRef identifies one JetStream event handled by a consumer.
type EventRef struct {
	ID        string // the event id: the key of the event inbox; must be valid text (pgdata.ValidText)
	Subject   string
	StreamSeq int64
}

const claimEventsSQL = `
INSERT INTO kfn.event_inbox (consumer, event_id, subject, stream_seq, epoch, outcome)
SELECT $1, e.id, e.subject, e.seq, $2, $3
  FROM unnest($4::text[], $5::text[], $6::bigint[]) AS e(id, subject, seq)
ON CONFLICT DO NOTHING
RETURNING event_id`

// ClaimEvents inserts event inbox rows inside tx, in one round trip, and
// returns the set of ids that were not there yet.
func ClaimEvents(ctx context.Context, tx pgx.Tx, consumer string, token int64, outcome Outcome, events []EventRef) (map[string]bool, error) {
	ids := make([]string, len(events))
	subjects := make([]string, len(events))
	seqs := make([]int64, len(events))
	for i, e := range events {
		ids[i], subjects[i], seqs[i] = e.ID, pgdata.Text(e.Subject), e.StreamSeq
	}
	rows, err := tx.Query(ctx, claimEventsSQL, consumer, token, string(outcome), ids, subjects, seqs)
	if err != nil {
		return nil, fmt.Errorf("claim event inbox of %s: %w", consumer, err)
	}
	fresh, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("claim event inbox of %s: %w", consumer, err)
	}
	set := make(map[string]bool, len(fresh))
	for _, id := range fresh {
		set[id] = true
	}
	return set, nil
}

// MarkEventDeadLettered records an event as dead-lettered in the event
// inbox, inside tx.
func MarkEventDeadLettered(ctx context.Context, tx pgx.Tx, consumer string, token int64, e EventRef) error {
	_, err := tx.Exec(ctx, `
INSERT INTO kfn.event_inbox (consumer, event_id, subject, stream_seq, epoch, outcome) VALUES ($1, $2, $3, $4, $5, 'dead_lettered')
ON CONFLICT (consumer, event_id) DO UPDATE SET outcome = 'dead_lettered'`, consumer, e.ID, pgdata.Text(e.Subject), e.StreamSeq, token)
	if err != nil {
		return fmt.Errorf("mark event %s of %s dead-lettered: %w", e.ID, consumer, err)
	}
	return nil
}

// Fence checks inside tx that token is still the lane's epoch and records
// progress up to stream sequence seq. A JetStream lane's cursor is only a
// fence and a progress marker: redeliveries may come out of sequence order,
// so dedup is the event inbox's job.
func Fence(ctx context.Context, tx pgx.Tx, p Partition, token, seq int64) error {
	return fenceBy(ctx, tx, p, token, `
UPDATE kfn.cursors
   SET next_offset = greatest(next_offset, $5), high_water = greatest(high_water, $5), updated_at = now()
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch = $4`, seq+1)
}

// fenceBy runs sql, an UPDATE of p's cursor row guarded by epoch = token
// (parameters $1–$4: consumer, topic, partition, token; then extra), and
// returns a *FencedError when it changed no row.
func fenceBy(ctx context.Context, tx pgx.Tx, p Partition, token int64, sql string, extra ...any) error {
	args := append([]any{p.Consumer, p.Topic, p.Partition, token}, extra...)
	tag, err := tx.Exec(ctx, sql, args...)
	if err != nil {
		return fmt.Errorf("fence %s: %w", p, err)
	}
	if tag.RowsAffected() == 0 {
		stored, _ := ReadCursor(ctx, tx, p)
		return &FencedError{Partition: p, Token: token, Epoch: stored.Epoch}
	}
	return nil
}

// PurgeEvents deletes event inbox rows older than retention in batches of
// batchSize rows, each its own short statement, and returns how many it
// deleted. An event republished after its row is purged would be applied
// again, so the retention must be far longer than any outage of the relay.
func PurgeEvents(ctx context.Context, db Querier, retention time.Duration, batchSize int) (int64, error) {
	return deleteInBatches(ctx, db, "purge event inbox", batchSize, `
DELETE FROM kfn.event_inbox e
 USING (SELECT consumer, event_id FROM kfn.event_inbox WHERE processed_at < now() - $1::interval LIMIT $2) old
 WHERE (e.consumer, e.event_id) = (old.consumer, old.event_id)`, retention, batchSize)
}
