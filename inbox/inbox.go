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

// The inbox is keyed by lane and offset (migration 0012): a lane is the
// integer id kfn.lanes gives one (consumer, topic, partition). laneSQL is
// the id of the partition ($1, $2, $3), for statements on a partition whose
// lane exists: it is added when the partition is claimed (ClaimPartition).
const laneSQL = `(SELECT id FROM kfn.lanes WHERE consumer = $1 AND topic = $2 AND partition = $3)`

// withLane begins a statement that writes inbox rows of the partition ($1,
// $2, $3) whether or not its lane exists yet: the CTE lane holds its id,
// added if need be. Without the NOT EXISTS, ON CONFLICT would use up an id
// of the identity at every call.
const withLane = `
WITH added AS (
  INSERT INTO kfn.lanes (consumer, topic, partition) SELECT $1, $2, $3
   WHERE NOT EXISTS (SELECT FROM kfn.lanes WHERE consumer = $1 AND topic = $2 AND partition = $3)
  ON CONFLICT DO NOTHING
  RETURNING id
), lane AS (
  SELECT id FROM added UNION ALL SELECT id FROM kfn.lanes WHERE consumer = $1 AND topic = $2 AND partition = $3
)`

// AddLane gives partition p its lane id, unless it has one.
func AddLane(ctx context.Context, db Querier, p Partition) error {
	if _, err := db.Exec(ctx, withLane+` SELECT FROM lane`, p.Consumer, p.Topic, p.Partition); err != nil {
		return fmt.Errorf("add the lane of %s: %w", p, err)
	}
	return nil
}

const claimSQL = withLane + `
INSERT INTO kfn.inbox (lane, "offset", epoch, outcome)
SELECT (SELECT id FROM lane), o, $4, $5::text::kfn.outcome FROM unnest($6::bigint[]) AS o
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
	_, err := tx.Exec(ctx, withLane+`
INSERT INTO kfn.inbox (lane, "offset", epoch, outcome) VALUES ((SELECT id FROM lane), $4, $5, 'dead_lettered')
ON CONFLICT (lane, "offset") DO UPDATE SET outcome = 'dead_lettered'`,
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
  FROM kfn.inbox i JOIN kfn.lanes l ON l.id = i.lane WHERE l.consumer = $1`, consumer).Scan(&s.Applied, &s.DeadLettered, &oldest)
	if err != nil {
		return Stats{}, fmt.Errorf("read inbox stats of %s: %w", consumer, err)
	}
	if oldest != nil {
		s.Oldest = *oldest
	}
	return s, nil
}

// purgeHeadSQL deletes, from the first $2 inbox rows of lane $1 in offset
// order, those before the first row that must stay: a row younger than the
// retention ($3) or at or above the high-water mark of the cursor ($4, $5,
// $6), read by the statement itself (a re-execution lowers it). It reads
// the primary key only, so the inbox needs no index on processed_at.
const purgeHeadSQL = `
DELETE FROM kfn.inbox i
 USING (SELECT "offset",
               bool_or(processed_at >= now() - $3::interval
                       OR "offset" >= (SELECT high_water FROM kfn.cursors c
                                        WHERE c.consumer = $4 AND c.topic = $5 AND c.partition = $6))
                 OVER (ORDER BY "offset") AS stays -- this row or an earlier one stays
          FROM (SELECT "offset", processed_at FROM kfn.inbox WHERE lane = $1 ORDER BY "offset" LIMIT $2) head) old
 WHERE NOT old.stays AND i.lane = $1 AND i."offset" = old."offset"`

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
	type lane struct {
		id int32
		p  Partition
	}
	rows, err := db.Query(ctx, `
SELECT l.id, c.consumer, c.topic, c.partition
  FROM kfn.cursors c JOIN kfn.lanes l ON l.consumer = c.consumer AND l.topic = c.topic AND l.partition = c.partition
 ORDER BY c.consumer, c.topic, c.partition`)
	if err != nil {
		return 0, fmt.Errorf("purge inbox: list the cursors: %w", err)
	}
	lanes, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (lane, error) {
		var l lane
		err := row.Scan(&l.id, &l.p.Consumer, &l.p.Topic, &l.p.Partition)
		return l, err
	})
	if err != nil {
		return 0, fmt.Errorf("purge inbox: list the cursors: %w", err)
	}
	var total int64
	for _, l := range lanes {
		n, err := deleteInBatches(ctx, db, "purge inbox of "+l.p.String(), batchSize, purgeHeadSQL, l.id, batchSize, retention, l.p.Consumer, l.p.Topic, l.p.Partition)
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
