package operator

import (
	"context"
	"fmt"
	"time"

	"github.com/kfn-dev/kfn/inbox"
)

// fingerprintSQL normalises a dead letter's error text into its
// fingerprint: UUIDs become <id>, and every word that is a number or a hex
// string with a digit (an offset, an order number, a hash) becomes <n>, so
// "order 4411 not found" and "order 9 not found" fall into one group.
const fingerprintSQL = `regexp_replace(regexp_replace(error,
  '[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}', '<id>', 'g'),
  '\m[0-9a-fA-F]*[0-9][0-9a-fA-F]*\M', '<n>', 'g')`

// Page is a window of a listing: at most Limit rows (0: all of them) after
// the first Offset.
type Page struct{ Limit, Offset int }

// DeadLetterGroup is the dead letters of one function that failed for the
// same reason with the same error fingerprint.
type DeadLetterGroup struct {
	Function    string
	Reason      string // the dead letter reason: handler_error, parked, …
	Fingerprint string // the error text with numbers and ids normalised
	Example     string // the error text of the newest letter of the group
	Count       int64
	FirstSeen   time.Time
	LastSeen    time.Time
}

// DeadLetterGroups groups the dead letters of function (every function's
// when it is empty) by function, reason and error fingerprint, the largest
// group first, the groups of page.
func DeadLetterGroups(ctx context.Context, db inbox.Querier, function string, page Page) ([]DeadLetterGroup, error) {
	rows, err := db.Query(ctx, `SELECT consumer, reason, fp, count(*), min(dead_at), max(dead_at),
  (array_agg(error ORDER BY dead_at DESC, id DESC))[1]
 FROM (SELECT consumer, reason, error, dead_at, id, `+fingerprintSQL+` AS fp
        FROM kfn.dead_letters WHERE $1 = '' OR consumer = $1) d
 GROUP BY consumer, reason, fp
 ORDER BY count(*) DESC, consumer, reason, fp
 LIMIT CASE WHEN $2 <= 0 THEN NULL ELSE $2 END OFFSET $3`, function, page.Limit, page.Offset)
	if err != nil {
		return nil, fmt.Errorf("group dead letters: %w", err)
	}
	defer rows.Close()
	var groups []DeadLetterGroup
	for rows.Next() {
		var g DeadLetterGroup
		if err := rows.Scan(&g.Function, &g.Reason, &g.Fingerprint, &g.Count, &g.FirstSeen, &g.LastSeen, &g.Example); err != nil {
			return nil, fmt.Errorf("group dead letters: %w", err)
		}
		groups = append(groups, g)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("group dead letters: %w", err)
	}
	return groups, nil
}

// DeadLetterGroupIDs returns the ids of the dead letters of one group
// (function, reason, fingerprint), oldest first, the ids of page: the
// selection a group retry or discard hands to Retry or DiscardDeadLetters.
func DeadLetterGroupIDs(ctx context.Context, db inbox.Querier, function, reason, fingerprint string, page Page) ([]int64, error) {
	rows, err := db.Query(ctx, `SELECT id FROM kfn.dead_letters
 WHERE consumer = $1 AND reason = $2 AND `+fingerprintSQL+` = $3
 ORDER BY consumer, topic, partition, "offset"
 LIMIT CASE WHEN $4 <= 0 THEN NULL ELSE $4 END OFFSET $5`, function, reason, fingerprint, page.Limit, page.Offset)
	if err != nil {
		return nil, fmt.Errorf("select the dead letter group: %w", err)
	}
	defer rows.Close()
	var ids []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("select the dead letter group: %w", err)
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
}

// DeadLetterCounts counts every dead letter, and those dead-lettered at or
// after since, in one pass.
func DeadLetterCounts(ctx context.Context, db inbox.Querier, since time.Time) (total, recent int64, err error) {
	err = db.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE dead_at >= $1) FROM kfn.dead_letters`, since).Scan(&total, &recent)
	if err != nil {
		err = fmt.Errorf("count dead letters: %w", err)
	}
	return total, recent, err
}

// ParkedKey is a key a function with KeyOrder ParkKey holds back: its later
// records wait (as key_parked dead letters) behind the dead letter at
// BlockingOffset.
type ParkedKey struct {
	Partition      inbox.Partition
	Key            []byte
	BlockingOffset int64
	BlockingID     int64 // the id of the blocking dead letter; 0 when it is gone
	Waiting        int64 // key_parked dead letters behind it
	ParkedAt       time.Time
}

// ParkedKeys lists the parked keys of function (every function's when it
// is empty), the oldest first, the keys of page.
func ParkedKeys(ctx context.Context, db inbox.Querier, function string, page Page) ([]ParkedKey, error) {
	rows, err := db.Query(ctx, `SELECT p.consumer, p.topic, p.partition, p.record_key, p.blocking_offset, p.parked_at,
  coalesce((SELECT d.id FROM kfn.dead_letters d WHERE d.consumer = p.consumer AND d.topic = p.topic
             AND d.partition = p.partition AND d."offset" = p.blocking_offset), 0),
  (SELECT count(*) FROM kfn.dead_letters d WHERE d.consumer = p.consumer AND d.topic = p.topic
             AND d.partition = p.partition AND d.reason = 'key_parked' AND d.record_key = p.record_key)
 FROM kfn.parked_keys p WHERE $1 = '' OR p.consumer = $1
 ORDER BY p.parked_at, p.consumer, p.topic, p.partition
 LIMIT CASE WHEN $2 <= 0 THEN NULL ELSE $2 END OFFSET $3`, function, page.Limit, page.Offset)
	if err != nil {
		return nil, fmt.Errorf("list parked keys: %w", err)
	}
	defer rows.Close()
	var keys []ParkedKey
	for rows.Next() {
		var k ParkedKey
		if err := rows.Scan(&k.Partition.Consumer, &k.Partition.Topic, &k.Partition.Partition, &k.Key, &k.BlockingOffset, &k.ParkedAt,
			&k.BlockingID, &k.Waiting); err != nil {
			return nil, fmt.Errorf("list parked keys: %w", err)
		}
		keys = append(keys, k)
	}
	return keys, rows.Err()
}

// RelayBacklog is what the outbox holds that the relay has not published
// yet.
type RelayBacklog struct {
	Events int64
	Oldest time.Time // when the oldest unrelayed event was written; zero when there is none
}

// ReadRelayBacklog counts the events in kfn.outbox and finds the oldest.
func ReadRelayBacklog(ctx context.Context, db inbox.Querier) (RelayBacklog, error) {
	var b RelayBacklog
	var oldest *time.Time
	if err := db.QueryRow(ctx, `SELECT count(*), min(created_at) FROM kfn.outbox`).Scan(&b.Events, &oldest); err != nil {
		return b, fmt.Errorf("read the relay backlog: %w", err)
	}
	if oldest != nil {
		b.Oldest = *oldest
	}
	return b, nil
}
