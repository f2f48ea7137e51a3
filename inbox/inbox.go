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

// purgeHeadSQL deletes, from the first $4 inbox rows of one partition in
// offset order, those before the first row that must stay: a row younger
// than the retention ($5) or at or above the cursor's high-water mark.
// It reads the primary key only, so the inbox needs no index on
// processed_at.
const purgeHeadSQL = `
DELETE FROM kfn.inbox i
 USING (SELECT "offset",
               bool_or(processed_at >= now() - $5::interval
                       OR "offset" >= (SELECT high_water FROM kfn.cursors c
                                        WHERE c.consumer = $1 AND c.topic = $2 AND c.partition = $3))
                 OVER (ORDER BY "offset") AS stays -- this row or an earlier one stays
          FROM (SELECT "offset", processed_at FROM kfn.inbox
                 WHERE consumer = $1 AND topic = $2 AND partition = $3
                 ORDER BY "offset" LIMIT $4) head) old
 WHERE NOT old.stays AND i.consumer = $1 AND i.topic = $2 AND i.partition = $3 AND i."offset" = old."offset"`

// Purge deletes inbox rows older than retention, partition by partition
// in offset order, in statements of at most batchSize rows so no lock is
// held for long, and returns how many it deleted. Only rows below their
// cursor's high-water mark are purged, so dedup of Kafka records stays
// permanent: the high-water mark alone keeps those offsets from being
// applied again. A partition's purge stops at its first row that stays, so
// a row written again later (a re-executed record, a retried dead letter)
// holds back the rows after it until it is old enough itself, and the rows
// of a partition always go oldest offset first (which re-execution's
// checkInboxKept relies on).
func Purge(ctx context.Context, db Querier, retention time.Duration, batchSize int) (int64, error) {
	rows, err := db.Query(ctx, `SELECT consumer, topic, partition FROM kfn.cursors ORDER BY consumer, topic, partition`)
	if err != nil {
		return 0, fmt.Errorf("purge inbox: list the cursors: %w", err)
	}
	parts, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Partition, error) {
		var p Partition
		err := row.Scan(&p.Consumer, &p.Topic, &p.Partition)
		return p, err
	})
	if err != nil {
		return 0, fmt.Errorf("purge inbox: list the cursors: %w", err)
	}
	var total int64
	for _, p := range parts {
		n, err := deleteInBatches(ctx, db, "purge inbox of "+p.String(), batchSize, purgeHeadSQL, p.Consumer, p.Topic, p.Partition, batchSize, retention)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// deleteInBatches runs a DELETE (with args, among them its batch size)
// until it deletes fewer rows than batchSize.
func deleteInBatches(ctx context.Context, db Querier, what string, batchSize int, sql string, args ...any) (int64, error) {
	var total int64
	for {
		tag, err := db.Exec(ctx, sql, args...)
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
