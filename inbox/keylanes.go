package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Key-lanes (migration 0014_key_lanes). A function with KeyConcurrency
// K > 1 splits each partition (or subject lane) it owns over K key-lanes by
// key hash, and each key-lane commits in transactions of its own. Such a
// transaction is fenced by its key-lane's row in kfn.key_lanes, under the
// partition's token, instead of the cursor row: K rows, so the key-lanes
// never wait for each other's locks. A claim of the partition writes its
// new epoch into every key-lane row of the partition (the trigger
// kfn.fence_key_lanes, whoever writes the epoch: a claim, a replay), which
// waits for the key-lane transactions in flight; the ones after it find
// another epoch and are fenced. The cursor itself moves in transactions of
// its own (Advance), over the offsets every key-lane has committed.

// claimKeyLanesSQL writes, in the claim's transaction (which holds the
// cursor row), the rows of the partition's key-lanes under the claim's
// token, and deletes those of key-lanes the new owner does not run. A
// lane's progress starts at the cursor.
const claimKeyLanesSQL = `
WITH gone AS (
  DELETE FROM kfn.key_lanes WHERE consumer = $1 AND topic = $2 AND partition = $3 AND lane >= $4
)
INSERT INTO kfn.key_lanes AS k (consumer, topic, partition, lane, lanes, epoch, next_offset)
SELECT $1, $2, $3, l, $4, $5, $6 FROM generate_series(0, $4 - 1) AS l
ON CONFLICT (consumer, topic, partition, lane) DO UPDATE
   SET lanes = EXCLUDED.lanes, epoch = EXCLUDED.epoch, next_offset = greatest(k.next_offset, EXCLUDED.next_offset), updated_at = now()`

// claimKeyLanes runs claimKeyLanesSQL for lanes key-lanes (1: none, and
// the rows of an earlier owner's key-lanes are deleted).
func claimKeyLanes(ctx context.Context, tx pgx.Tx, p Partition, token int64, lanes int, next int64) error {
	if _, err := tx.Exec(ctx, claimKeyLanesSQL, p.Consumer, p.Topic, p.Partition, keyLaneRows(lanes), token, next); err != nil {
		return fmt.Errorf("claim the %d key-lanes of %s: %w", lanes, p, err)
	}
	return nil
}

// keyLaneRows is how many key-lane rows a partition run with lanes
// key-lanes keeps: none when it runs as one lane.
func keyLaneRows(lanes int) int {
	if lanes <= 1 {
		return 0
	}
	return lanes
}

// fenceKeyLaneSQL fences a key-lane's transaction: it writes the key-lane's
// row under the partition's token, and records its progress.
const fenceKeyLaneSQL = `
UPDATE kfn.key_lanes SET next_offset = greatest(next_offset, $6), updated_at = now()
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND lane = $4 AND epoch = $5`

// FenceKeyLane fences tx for key-lane lane of p under token, and records
// that the key-lane got to next (the offset after its last record; 0 for
// none). It returns a *FencedError when a newer owner (or a replay) has
// claimed p since.
func FenceKeyLane(ctx context.Context, tx pgx.Tx, p Partition, lane int, token, next int64) error {
	tag, err := tx.Exec(ctx, fenceKeyLaneSQL, p.Consumer, p.Topic, p.Partition, lane, token, next)
	if err != nil {
		return fmt.Errorf("fence key-lane %d of %s: %w", lane, p, err)
	}
	if tag.RowsAffected() == 0 {
		return keyLaneFenced(ctx, tx, p, token)
	}
	return nil
}

// keyLaneFenced is the *FencedError of a key-lane whose row did not take
// token: the partition's epoch is another now.
func keyLaneFenced(ctx context.Context, tx pgx.Tx, p Partition, token int64) error {
	stored, err := ReadCursor(ctx, tx, p)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("fence key-lane of %s: its row did not take token %d; reading the cursor: %w", p, token, err)
	}
	return &FencedError{Partition: p, Token: token, Epoch: stored.Epoch}
}

// fenceKeyLaneAndClaimSQL is fenceKeyLaneSQL and claimSQL in one statement:
// the inbox rows are inserted only if the key-lane's row took the token.
// Other key-lanes of the partition claim offsets between this one's, and
// offsets above the cursor may hold rows from before a crash, so every row
// goes through ON CONFLICT DO NOTHING.
const fenceKeyLaneAndClaimSQL = `
WITH fence AS (
  UPDATE kfn.key_lanes SET next_offset = greatest(next_offset, $6), updated_at = now()
   WHERE consumer = $1 AND topic = $2 AND partition = $3 AND lane = $4 AND epoch = $5
  RETURNING 1
), lane AS (
  SELECT id FROM kfn.lanes WHERE consumer = $1 AND topic = $2 AND partition = $3
), claim AS (
  INSERT INTO kfn.inbox (lane, "offset", epoch)
  SELECT (SELECT id FROM lane), o, $5 FROM unnest($7::bigint[]) AS o
   WHERE EXISTS (SELECT FROM fence)
  ON CONFLICT DO NOTHING
  RETURNING "offset"
)
SELECT (SELECT count(*) FROM fence), coalesce((SELECT array_agg("offset" ORDER BY "offset") FROM claim), '{}')`

// QueueFenceKeyLaneAndClaim queues on b, for a transaction b begins,
// FenceKeyLane and Claim (of offsets, as applied) as one statement. Once b
// has been sent and closed, the returned function, given b's transaction,
// returns the offsets that were not in the inbox yet, in ascending order,
// or a *FencedError; when the fence refused, nothing was claimed.
func QueueFenceKeyLaneAndClaim(b *pgx.Batch, p Partition, lane int, token, next int64, offsets []int64) func(context.Context, pgx.Tx) ([]int64, error) {
	if offsets == nil {
		offsets = []int64{}
	}
	var fenced int64
	var fresh []int64
	scanned := false
	b.Queue(fenceKeyLaneAndClaimSQL, p.Consumer, p.Topic, p.Partition, lane, token, next, offsets).QueryRow(func(row pgx.Row) error {
		if err := row.Scan(&fenced, &fresh); err != nil {
			return fmt.Errorf("fence key-lane %d of %s and claim its inbox: %w", lane, p, err)
		}
		scanned = true
		return nil
	})
	return func(ctx context.Context, tx pgx.Tx) ([]int64, error) {
		switch {
		case !scanned:
			return nil, fmt.Errorf("fence key-lane %d of %s and claim its inbox: the statement did not run", lane, p)
		case fenced == 0:
			return nil, keyLaneFenced(ctx, tx, p, token)
		}
		return fresh, nil
	}
}

// KeyLane is the stored progress of one key-lane of a partition.
type KeyLane struct {
	Lane       int       `json:"lane"`
	Lanes      int       `json:"lanes"`
	Epoch      int64     `json:"epoch"`
	NextOffset int64     `json:"next_offset"` // the offset after the last record it committed
	UpdatedAt  time.Time `json:"updated_at"`
}

// ReadKeyLanes returns the key-lanes of p, by lane; none for a partition
// run as one lane.
func ReadKeyLanes(ctx context.Context, db Querier, p Partition) ([]KeyLane, error) {
	rows, err := db.Query(ctx, `
SELECT lane, lanes, epoch, next_offset, updated_at FROM kfn.key_lanes
 WHERE consumer = $1 AND topic = $2 AND partition = $3 ORDER BY lane`, p.Consumer, p.Topic, p.Partition)
	if err != nil {
		return nil, fmt.Errorf("read the key-lanes of %s: %w", p, err)
	}
	lanes, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (KeyLane, error) {
		var k KeyLane
		err := row.Scan(&k.Lane, &k.Lanes, &k.Epoch, &k.NextOffset, &k.UpdatedAt)
		return k, err
	})
	if err != nil {
		return nil, fmt.Errorf("read the key-lanes of %s: %w", p, err)
	}
	return lanes, nil
}
