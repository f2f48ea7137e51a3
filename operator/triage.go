package operator

import (
	"context"
	"fmt"
	"time"

	"github.com/kfn-dev/kfn/inbox"
)

// Page is a window of a listing: at most Limit rows (0: all of them) after
// the first Offset.
type Page struct{ Limit, Offset int }

// DeadLetterGroup is the dead letters of one function that failed for the
// same reason with the same error fingerprint.
type DeadLetterGroup struct {
	Function    string
	Reason      string // the dead letter reason: handler_error, parked, …
	Fingerprint string // the error text with numbers and ids normalised (kfn.error_fingerprint, migration 0015)
	Example     string // the error text of the newest letter of the group
	Count       int64
	FirstSeen   time.Time
	LastSeen    time.Time
}

// DeadLetterGroups groups the dead letters of function (every function's
// when it is empty) by function, reason and error fingerprint, the largest
// group first, the groups of page.
func DeadLetterGroups(ctx context.Context, db inbox.Querier, function string, page Page) ([]DeadLetterGroup, error) {
	// The groups of the page first, then each one's newest error through
	// the dead_letters_group index.
	rows, err := db.Query(ctx, `SELECT g.consumer, g.reason, g.fp, g.n, g.first_seen, g.last_seen, e.error
 FROM (SELECT consumer, reason, error_fingerprint AS fp, count(*) AS n, min(dead_at) AS first_seen, max(dead_at) AS last_seen
         FROM kfn.dead_letters WHERE $1 = '' OR consumer = $1
        GROUP BY consumer, reason, error_fingerprint
        ORDER BY count(*) DESC, consumer, reason, error_fingerprint
        LIMIT CASE WHEN $2 <= 0 THEN NULL ELSE $2 END OFFSET $3) g
 CROSS JOIN LATERAL (SELECT d.error FROM kfn.dead_letters d
        WHERE d.consumer = g.consumer AND d.reason = g.reason AND md5(d.error_fingerprint) = md5(g.fp) AND d.error_fingerprint = g.fp
        ORDER BY d.dead_at DESC, d.id DESC LIMIT 1) e
 ORDER BY g.n DESC, g.consumer, g.reason, g.fp`, function, page.Limit, page.Offset)
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
 WHERE consumer = $1 AND reason = $2 AND md5(error_fingerprint) = md5($3) AND error_fingerprint = $3
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
