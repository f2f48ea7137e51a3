package inbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Outcome is how a handled record ended.
type Outcome string

const (
	Applied      Outcome = "applied"       // the handler's transaction committed
	DeadLettered Outcome = "dead_lettered" // the record was parked in kfn.dead_letters
)

const claimSQL = `
INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch, outcome)
SELECT $1, $2, $3, o, $4, $5 FROM unnest($6::bigint[]) AS o
ON CONFLICT DO NOTHING
RETURNING "offset"`

// Claim inserts inbox rows for offsets inside tx, in one round trip, and
// returns the offsets that were not there yet (in ascending order). An offset
// already in the inbox was handled before and must be skipped.
func Claim(ctx context.Context, tx pgx.Tx, p Partition, token int64, outcome Outcome, offsets []int64) ([]int64, error) {
	if len(offsets) == 0 {
		return nil, nil
	}
	rows, err := tx.Query(ctx, claimSQL, p.Consumer, p.Topic, p.Partition, token, string(outcome), offsets)
	if err != nil {
		return nil, fmt.Errorf("claim inbox of %s: %w", p, err)
	}
	fresh, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("claim inbox of %s: %w", p, err)
	}
	sortInt64s(fresh)
	return fresh, nil
}

func sortInt64s(s []int64) {
	// RETURNING order follows unnest order in practice, but that is not a
	// guarantee Postgres makes; an insertion sort is cheap on sorted input.
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

// MarkDeadLettered records a Kafka record as dead-lettered in the inbox,
// inside tx. The record may already hold an inbox row from its own batch's
// claim (an oversized record is parked inside that batch's transaction).
func MarkDeadLettered(ctx context.Context, tx pgx.Tx, p Partition, token, offset int64) error {
	_, err := tx.Exec(ctx, `
INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch, outcome) VALUES ($1, $2, $3, $4, $5, 'dead_lettered')
ON CONFLICT (consumer, topic, partition, "offset") DO UPDATE SET outcome = 'dead_lettered'`,
		p.Consumer, p.Topic, p.Partition, offset, token)
	if err != nil {
		return fmt.Errorf("mark %s@%d dead-lettered in the inbox: %w", p, offset, err)
	}
	return nil
}

// Stats summarises a consumer's inbox.
type Stats struct {
	Applied      int64
	DeadLettered int64
	Oldest       time.Time
}

// ReadStats counts the inbox rows of a consumer.
func ReadStats(ctx context.Context, db Querier, consumer string) (Stats, error) {
	var s Stats
	var oldest *time.Time
	err := db.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE outcome = 'applied'), count(*) FILTER (WHERE outcome = 'dead_lettered'), min(processed_at)
  FROM kfn.inbox WHERE consumer = $1`, consumer).Scan(&s.Applied, &s.DeadLettered, &oldest)
	if err != nil {
		return Stats{}, fmt.Errorf("read inbox stats of %s: %w", consumer, err)
	}
	if oldest != nil {
		s.Oldest = *oldest
	}
	return s, nil
}

// Purge deletes inbox rows older than retention in batches of batchSize rows,
// each its own short statement so no lock is held for long, and returns how
// many it deleted. Only rows below their cursor's high-water mark are purged,
// so dedup of Kafka records stays permanent: the high-water mark alone keeps
// those offsets from being applied again.
func Purge(ctx context.Context, db Querier, retention time.Duration, batchSize int) (int64, error) {
	return deleteInBatches(ctx, db, "purge inbox", `
DELETE FROM kfn.inbox i
 USING (SELECT i2.consumer, i2.topic, i2.partition, i2."offset"
          FROM kfn.inbox i2
          JOIN kfn.cursors c USING (consumer, topic, partition)
         WHERE i2.processed_at < now() - $1::interval AND i2."offset" < c.high_water
         LIMIT $2) old
 WHERE (i.consumer, i.topic, i.partition, i."offset") = (old.consumer, old.topic, old.partition, old."offset")`,
		retention, batchSize)
}

// deleteInBatches runs a DELETE that takes (retention, batch size) until it
// deletes fewer rows than a batch.
func deleteInBatches(ctx context.Context, db Querier, what, sql string, retention time.Duration, batchSize int) (int64, error) {
	var total int64
	for {
		tag, err := db.Exec(ctx, sql, retention, batchSize)
		if err != nil {
			return total, fmt.Errorf("%s: %w", what, err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batchSize) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}
