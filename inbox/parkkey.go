package inbox

import (
	"context"
	"errors"
	"fmt"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/internal/pgdata"
)

// Parking by key (a function with KeyOrder ParkKey). When a lane
// dead-letters a record of key K from partition P, it also blocks K on P
// (ParkKey, a row of kfn.parked_keys, in the dead letter's transaction).
// Every later record of K on P is then dead-lettered with reason
// ReasonKeyParked instead of reaching the handler. A key is released, in
// the transaction that deletes its blocking dead letter, when that letter
// is retried successfully (the lane's retry, ReleaseKeys) or discarded or
// purged (DiscardDeadLetters, PurgeDeadLetters): its row goes and its
// key_parked letters are marked for retry, so the lane applies them in
// offset order through the dead letter retry (retry.go). While those are
// marked the key is still held (HeldKeys, CheckHeldKeys): a later record of
// K is parked and marked behind them. A parked letter whose retry fails
// becomes the key's blocker (BlockAfterFailedRetry), and the key's later
// letters are unmarked.
//
// A lane is the only writer of its partition's blocks (under its fence);
// others only release them. So a lane keeps its held keys in memory, and
// checks inside each batch transaction, under a lock that a release waits
// for, those of the batch's keys that its memory says are held.

// ReasonKeyParked is the dead-letter reason of a record parked behind an
// earlier dead-lettered record of its key.
const ReasonKeyParked = "key_parked"

// ActionKeyReleased is the audit action of a key released: the dead letter
// that blocked it was retried, discarded or purged, and the key's parked
// letters were marked for retry.
const ActionKeyReleased = "key_released"

// HeldKey is a key whose records a lane must not hand to the handler.
type HeldKey struct {
	Key []byte
	// Offset is the blocking dead letter's offset; for a Released key, the
	// offset of its first parked letter still marked for retry.
	Offset int64
	// Released says the key has no blocker any more but some of its parked
	// letters are still marked for retry: a later record must follow them.
	Released bool
}

// HeldKeys returns the held keys of p: those blocked (a row of
// kfn.parked_keys) and those released whose parked letters are not all
// applied yet. A lane loads them when it claims p and again whenever it
// looks for dead letters to retry.
func HeldKeys(ctx context.Context, db Querier, p Partition) ([]HeldKey, error) {
	rows, err := db.Query(ctx, `
SELECT record_key, blocking_offset, false FROM kfn.parked_keys
 WHERE consumer = $1 AND topic = $2 AND partition = $3
UNION ALL
SELECT record_key, min("offset"), true FROM kfn.dead_letters d
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND retry_requested_at IS NOT NULL AND reason = '`+ReasonKeyParked+`'
   AND record_key IS NOT NULL
   AND NOT EXISTS (SELECT 1 FROM kfn.parked_keys k WHERE k.consumer = $1 AND k.topic = $2 AND k.partition = $3 AND k.record_key = d.record_key)
 GROUP BY record_key`, p.Consumer, p.Topic, p.Partition)
	if err != nil {
		return nil, fmt.Errorf("read the parked keys of %s: %w", p, err)
	}
	held, err := pgx.CollectRows(rows, pgx.RowToStructByPos[HeldKey])
	if err != nil {
		return nil, fmt.Errorf("read the parked keys of %s: %w", p, err)
	}
	return held, nil
}

// CheckHeldKeys returns which of keys are held on p, inside a lane's batch
// transaction tx. It locks the keys' kfn.parked_keys rows (FOR SHARE) in a
// statement of its own before it looks for released keys' marked letters
// in a second one: a release deletes the row before it marks the letters,
// so it either commits before the first statement returns (and the second,
// with a newer snapshot, sees its marks) or waits until tx ends (and then
// marks what tx parked).
func CheckHeldKeys(ctx context.Context, tx pgx.Tx, p Partition, keys [][]byte) ([]HeldKey, error) {
	if len(keys) == 0 {
		return nil, nil
	}
	rows, err := tx.Query(ctx, `
SELECT record_key, blocking_offset, false FROM kfn.parked_keys
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND record_key = ANY($4::bytea[])
   FOR SHARE`, p.Consumer, p.Topic, p.Partition, keys)
	if err != nil {
		return nil, fmt.Errorf("check the parked keys of %s: %w", p, err)
	}
	held, err := pgx.CollectRows(rows, pgx.RowToStructByPos[HeldKey])
	if err != nil {
		return nil, fmt.Errorf("check the parked keys of %s: %w", p, err)
	}
	blocked := make(map[string]bool, len(held))
	for _, h := range held {
		blocked[string(h.Key)] = true
	}
	var rest [][]byte
	for _, k := range keys {
		if !blocked[string(k)] {
			rest = append(rest, k)
		}
	}
	if len(rest) == 0 {
		return held, nil
	}
	rows, err = tx.Query(ctx, `
SELECT record_key, min("offset"), true FROM kfn.dead_letters
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND retry_requested_at IS NOT NULL AND reason = '`+ReasonKeyParked+`'
   AND record_key = ANY($4::bytea[])
 GROUP BY record_key`, p.Consumer, p.Topic, p.Partition, rest)
	if err != nil {
		return nil, fmt.Errorf("check the parked keys of %s: %w", p, err)
	}
	released, err := pgx.CollectRows(rows, pgx.RowToStructByPos[HeldKey])
	if err != nil {
		return nil, fmt.Errorf("check the parked keys of %s: %w", p, err)
	}
	return append(held, released...), nil
}

// ParkKey blocks key on p behind the dead letter at offset, inside the
// transaction tx that writes that dead letter. A key blocked already keeps
// the lower of the two offsets.
func ParkKey(ctx context.Context, tx pgx.Tx, p Partition, key []byte, offset int64) error {
	_, err := tx.Exec(ctx, `
INSERT INTO kfn.parked_keys AS k (consumer, topic, partition, record_key, blocking_offset) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (consumer, topic, partition, record_key) DO UPDATE SET blocking_offset = least(k.blocking_offset, EXCLUDED.blocking_offset)`,
		p.Consumer, p.Topic, p.Partition, key, offset)
	if err != nil {
		return fmt.Errorf("park key of %s@%d: %w", p, offset, err)
	}
	return nil
}

// KeyParkedError is the error of a key_parked dead letter: the offset of
// the dead letter it waits behind.
func KeyParkedError(blockingOffset int64) string {
	return fmt.Sprintf("key parked behind the dead letter at offset %d: applied in offset order once that one is retried or discarded", blockingOffset)
}

// MarkParkedForRetry marks the key_parked letters of p at offsets for
// retry, inside the lane's transaction tx that writes them: their keys were
// released and the keys' earlier parked letters are marked, so these follow
// them.
func MarkParkedForRetry(ctx context.Context, tx pgx.Tx, p Partition, offsets []int64, actor string) error {
	if len(offsets) == 0 {
		return nil
	}
	_, err := tx.Exec(ctx, `
UPDATE kfn.dead_letters SET retry_requested_at = now(), retry_actor = $5, retry_reason = 'key released: follows the parked records of its key'
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND "offset" = ANY($4::bigint[]) AND reason = '`+ReasonKeyParked+`'`,
		p.Consumer, p.Topic, p.Partition, offsets, pgdata.Text(actor))
	if err != nil {
		return fmt.Errorf("mark the parked records of %s for retry: %w", p, err)
	}
	if _, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, RetryNotifyChannel, p.Consumer); err != nil {
		return fmt.Errorf("notify the workers: %w", err)
	}
	return nil
}

// LetterRef names a dead letter by its record: a partition and an offset.
type LetterRef struct {
	Partition Partition
	Offset    int64
}

// ReleasedKey is a key released by ReleaseKeys.
type ReleasedKey struct {
	Partition      Partition
	Key            []byte
	BlockingOffset int64
	Marked         int // its key_parked letters, now marked for retry
}

// ReleaseKeys releases, inside tx, the keys blocked by the dead letters
// that tx deletes (letters: their records), and marks each released key's
// key_parked letters for retry, so the lane applies them in offset order.
// how says why the blocker went (retried, discarded, purged) for the audit
// log, where each release is written (ActionKeyReleased); the workers are
// notified at commit.
func ReleaseKeys(ctx context.Context, tx pgx.Tx, actor, how string, letters []LetterRef) ([]ReleasedKey, error) {
	if len(letters) == 0 {
		return nil, nil
	}
	consumers, topics := make([]string, len(letters)), make([]string, len(letters))
	partitions, offsets := make([]int32, len(letters)), make([]int64, len(letters))
	for i, l := range letters {
		consumers[i], topics[i], partitions[i], offsets[i] = l.Partition.Consumer, l.Partition.Topic, l.Partition.Partition, l.Offset
	}
	rows, err := tx.Query(ctx, `
DELETE FROM kfn.parked_keys k USING unnest($1::text[], $2::text[], $3::integer[], $4::bigint[]) AS l (consumer, topic, partition, off)
 WHERE k.consumer = l.consumer AND k.topic = l.topic AND k.partition = l.partition AND k.blocking_offset = l.off
RETURNING k.consumer, k.topic, k.partition, k.record_key, k.blocking_offset`, consumers, topics, partitions, offsets)
	if err != nil {
		return nil, fmt.Errorf("release parked keys: %w", err)
	}
	var released []ReleasedKey
	var r ReleasedKey
	_, err = pgx.ForEachRow(rows, []any{&r.Partition.Consumer, &r.Partition.Topic, &r.Partition.Partition, &r.Key, &r.BlockingOffset}, func() error {
		released = append(released, r)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("release parked keys: %w", err)
	}
	notified := map[string]bool{}
	for i := range released {
		r := &released[i]
		tag, err := tx.Exec(ctx, `
UPDATE kfn.dead_letters SET retry_requested_at = now(), retry_actor = $5, retry_reason = $6
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND record_key = $4 AND reason = '`+ReasonKeyParked+`'`,
			r.Partition.Consumer, r.Partition.Topic, r.Partition.Partition, r.Key, pgdata.Text(actor),
			fmt.Sprintf("key released: the dead letter at offset %d that parked it was %s", r.BlockingOffset, how))
		if err != nil {
			return nil, fmt.Errorf("mark the parked records of a released key of %s for retry: %w", r.Partition, err)
		}
		r.Marked = int(tag.RowsAffected())
		details := map[string]any{"blocking_offset": r.BlockingOffset, "how": how, "marked_for_retry": r.Marked}
		keyDetail(details, r.Key)
		if err := writeAudit(ctx, tx, actor, ActionKeyReleased, r.Partition, details); err != nil {
			return nil, err
		}
		if !notified[r.Partition.Consumer] {
			notified[r.Partition.Consumer] = true
			if _, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, RetryNotifyChannel, r.Partition.Consumer); err != nil {
				return nil, fmt.Errorf("notify the workers: %w", err)
			}
		}
	}
	return released, nil
}

// keyDetail puts a record key in audit details: as text ("key") when it is
// printable UTF-8, in hex ("key_hex") otherwise.
func keyDetail(details map[string]any, key []byte) {
	printable := utf8.Valid(key)
	for _, r := range string(key) {
		if !printable || !unicode.IsPrint(r) {
			printable = false
			break
		}
	}
	if printable {
		details["key"] = string(key)
	} else {
		details["key_hex"] = fmt.Sprintf("%x", key)
	}
}

// BlockAfterFailedRetry makes l, a key_parked letter whose retry failed
// with cause, the blocker of its key, inside tx: the key is blocked at l's
// offset, l's reason and error become its own (reason), and the key's
// later key_parked letters are no longer marked for retry (they must not
// be applied before l) and name l's offset. It returns false, changing
// nothing, when l is gone (discarded since it was taken).
func BlockAfterFailedRetry(ctx context.Context, tx pgx.Tx, l RetryLetter, reason, cause string) (bool, error) {
	// Lock the letter first: a discard that deletes it either did so before
	// (nothing to block) or waits for tx, and then releases the key.
	err := tx.QueryRow(ctx, `
UPDATE kfn.dead_letters SET reason = $2, error = $3 WHERE id = $1 RETURNING id`, l.ID, pgdata.Text(reason), pgdata.Text(cause)).Scan(new(int64))
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("block the key of dead letter %d: %w", l.ID, err)
	}
	p := l.Partition
	if err := ParkKey(ctx, tx, p, l.Key, l.Offset); err != nil {
		return false, err
	}
	_, err = tx.Exec(ctx, `
UPDATE kfn.dead_letters SET retry_requested_at = NULL, error = $6
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND record_key = $4 AND "offset" > $5 AND reason = '`+ReasonKeyParked+`'`,
		p.Consumer, p.Topic, p.Partition, l.Key, l.Offset, KeyParkedError(l.Offset))
	if err != nil {
		return false, fmt.Errorf("hold back the parked records behind dead letter %d: %w", l.ID, err)
	}
	return true, nil
}

// ParkedBehind returns the offset of the dead letter that blocks key on p
// when it is below offset: a parked letter at offset must not be applied
// before it.
func ParkedBehind(ctx context.Context, tx pgx.Tx, p Partition, key []byte, offset int64) (int64, bool, error) {
	var blocking int64
	err := tx.QueryRow(ctx, `
SELECT blocking_offset FROM kfn.parked_keys
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND record_key = $4 AND blocking_offset < $5`,
		p.Consumer, p.Topic, p.Partition, key, offset).Scan(&blocking)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("check the parked key of %s@%d: %w", p, offset, err)
	}
	return blocking, true, nil
}

// RetryHeldBack records inside tx that the retry of l, a key_parked
// letter, was not applied because its key is parked behind the dead letter
// at blockingOffset: l stays, no longer marked, its attempts unchanged,
// and the audit log says why (a dlq_retry_failed row). It follows that
// letter when that one is retried or discarded. It returns false when l is
// gone or was marked again since it was taken.
func RetryHeldBack(ctx context.Context, tx pgx.Tx, actor string, l RetryLetter, token, blockingOffset int64) (bool, error) {
	tag, err := tx.Exec(ctx, `UPDATE kfn.dead_letters SET retry_requested_at = NULL WHERE id = $1 AND retry_requested_at = $2`, l.ID, l.RequestedAt)
	if err != nil {
		return false, fmt.Errorf("hold back dead letter %d: %w", l.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return false, nil
	}
	details := retryDetails(l, token)
	details["error"] = HeldBackMessage(blockingOffset)
	return true, writeAudit(ctx, tx, actor, ActionRetryFailed, l.Partition, details)
}

// HeldBackMessage says why a key_parked letter is not retried: its key is
// parked behind an earlier dead letter.
func HeldBackMessage(blockingOffset int64) string {
	return fmt.Sprintf("not applied: its key is parked behind the dead letter at offset %d; "+
		"retry or discard that one, and this one follows it in offset order", blockingOffset)
}
