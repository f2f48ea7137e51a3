// Package inbox owns the bookkeeping that makes a function exactly-once in
// Postgres: the partition cursors with their fencing epochs, the lane
// counts of NATS-triggered functions, the inboxes of handled records and
// events, the dead letters, replays and retention.
//
// Every write that moves a cursor checks the caller's fencing token, so a
// worker that lost its partition (a zombie) cannot commit anything.
package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Partition names one source partition as seen by one consumer (function).
type Partition struct {
	Consumer  string `json:"function"` // in kfn's JSON output, as everywhere in the CLI
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
}

func (p Partition) String() string {
	return fmt.Sprintf("%s/%s/%d", p.Consumer, p.Topic, p.Partition)
}

// Cursor is the stored position of a partition.
type Cursor struct {
	NextOffset int64 // first offset not handled yet: where to resume
	HighWater  int64 // every offset below it has been handled, ever
	Generation int   // re-executions so far; part of the ids of emitted events
	Epoch      int64 // fencing token of the current owner
	Owner      string
}

// FencedError means the caller's token is no longer the partition's epoch:
// another owner (or a replay) has claimed it since. The caller must stop
// using the partition.
type FencedError struct {
	Partition Partition
	Token     int64 // the caller's token
	Epoch     int64 // the epoch stored now (0 if unknown)
}

func (e *FencedError) Error() string {
	return fmt.Sprintf("partition %s is fenced: token %d is stale, current epoch is %d", e.Partition, e.Token, e.Epoch)
}

// ErrFenced matches any *FencedError with errors.Is.
var ErrFenced = errors.New("fenced")

func (e *FencedError) Is(target error) bool { return target == ErrFenced }

// Querier is what the store functions need: a pool, a connection or a tx.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

const claimPartitionSQL = `
INSERT INTO kfn.cursors AS c (consumer, topic, partition, next_offset, high_water, epoch, owner)
VALUES ($1, $2, $3, $4, $4, $5, $6)
ON CONFLICT (consumer, topic, partition) DO UPDATE
   SET epoch = EXCLUDED.epoch, owner = EXCLUDED.owner, claimed_at = now()
 WHERE c.epoch < EXCLUDED.epoch
    OR (c.epoch = EXCLUDED.epoch AND c.owner = EXCLUDED.owner) -- our own claim whose reply was lost
RETURNING next_offset, high_water, generation, epoch, owner`

// ClaimPartition records token as the partition's epoch, provided it is
// greater than the stored one, and returns the cursor to resume from. A new
// partition starts at startOffset. A token that is not greater than the
// stored epoch gives a *FencedError: a newer owner exists. Claiming again
// with the stored token and owner succeeds, so a claim whose reply was lost
// can be retried (a token names one ownership term, never two owners).
//
// Every successful claim writes a "claim" row to kfn.audit_log in the same
// transaction (see auditClaim), and gives the partition its lane id in
// kfn.lanes, which keys its inbox rows, if it has none yet: the partition's epoch history, which inbox
// retention never deletes. db is a pool, a connection or a transaction;
// outside a transaction the claim runs in one of its own, so that the claim
// and its audit row commit together or not at all.
func ClaimPartition(ctx context.Context, db interface {
	Begin(context.Context) (pgx.Tx, error)
	Querier
}, p Partition, token int64, owner string, startOffset int64) (Cursor, error) {
	if tx, ok := db.(pgx.Tx); ok {
		return claimPartition(ctx, tx, p, token, owner, startOffset)
	}
	var c Cursor
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) (err error) {
		c, err = claimPartition(ctx, tx, p, token, owner, startOffset)
		return err
	})
	return c, err
}

func claimPartition(ctx context.Context, tx pgx.Tx, p Partition, token int64, owner string, startOffset int64) (Cursor, error) {
	var c Cursor
	err := tx.QueryRow(ctx, claimPartitionSQL, p.Consumer, p.Topic, p.Partition, startOffset, token, owner).
		Scan(&c.NextOffset, &c.HighWater, &c.Generation, &c.Epoch, &c.Owner)
	if errors.Is(err, pgx.ErrNoRows) {
		stored, _ := ReadCursor(ctx, tx, p)
		return Cursor{}, &FencedError{Partition: p, Token: token, Epoch: stored.Epoch}
	}
	if err != nil {
		return Cursor{}, fmt.Errorf("claim partition %s with token %d: %w", p, token, err)
	}
	if err := auditClaim(ctx, tx, p, token, owner, c); err != nil {
		return Cursor{}, err
	}
	// The batches' inbox claims (fenceAndClaimSQL) find the partition's
	// lane; it is added once, by its first claim.
	if err := AddLane(ctx, tx, p); err != nil {
		return Cursor{}, err
	}
	return c, nil
}

// NextEpoch returns a token greater than the partition's stored epoch, for
// owners that are not coordinated through NATS (a single worker, the CLI).
func NextEpoch(ctx context.Context, db Querier, p Partition) (int64, error) {
	var epoch int64
	err := db.QueryRow(ctx, `SELECT coalesce(max(epoch), 0) + 1 FROM kfn.cursors WHERE consumer = $1 AND topic = $2 AND partition = $3`,
		p.Consumer, p.Topic, p.Partition).Scan(&epoch)
	if err != nil {
		return 0, fmt.Errorf("read epoch of %s: %w", p, err)
	}
	return epoch, nil
}

// ReadCursor returns the stored cursor, or pgx.ErrNoRows wrapped if there is none.
func ReadCursor(ctx context.Context, db Querier, p Partition) (Cursor, error) {
	var c Cursor
	err := db.QueryRow(ctx, `SELECT next_offset, high_water, generation, epoch, owner FROM kfn.cursors WHERE consumer = $1 AND topic = $2 AND partition = $3`,
		p.Consumer, p.Topic, p.Partition).Scan(&c.NextOffset, &c.HighWater, &c.Generation, &c.Epoch, &c.Owner)
	if err != nil {
		return Cursor{}, fmt.Errorf("read cursor of %s: %w", p, err)
	}
	return c, nil
}

const advanceSQL = `
UPDATE kfn.cursors
   SET next_offset = $6, high_water = greatest(high_water, $6), updated_at = now()
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch = $4 AND next_offset = $5`

// Advance moves the cursor from `from` to `to` inside tx, and is the fence of
// every commit: it succeeds only while the stored epoch equals token and the
// cursor is still at from. Otherwise the caller must roll back, and the
// error says why: a *FencedError when the partition changed hands (or was
// replayed: a newer token is stored), a *CursorMovedError when the token is
// still the caller's but the cursor is elsewhere (the caller's own earlier
// commit landed although it never saw the reply).
func Advance(ctx context.Context, tx pgx.Tx, p Partition, token, from, to int64) error {
	tag, err := tx.Exec(ctx, advanceSQL, p.Consumer, p.Topic, p.Partition, token, from, to)
	if err != nil {
		return fmt.Errorf("advance cursor of %s to %d: %w", p, to, err)
	}
	if tag.RowsAffected() == 0 {
		return advanceRefused(ctx, tx, p, token, from, to)
	}
	return nil
}

// advanceRefused says why the cursor did not move from `from` to `to`
// under token: a *FencedError or a *CursorMovedError.
func advanceRefused(ctx context.Context, tx pgx.Tx, p Partition, token, from, to int64) error {
	stored, err := ReadCursor(ctx, tx, p)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("advance cursor of %s to %d: it did not move; reading it: %w", p, to, err)
	}
	if err == nil && stored.Epoch == token {
		return &CursorMovedError{Partition: p, Token: token, From: from, Cursor: stored}
	}
	return &FencedError{Partition: p, Token: token, Epoch: stored.Epoch}
}

// fenceAndClaimSQL is advanceSQL and claimSQL in one statement: the inbox
// rows are inserted only if the fenced cursor update changed its row, under
// the partition's lane id, which its claim (ClaimPartition) added.
//
// The claimed offsets are at or above the high-water mark, where the inbox
// normally holds no row: only a bounded re-execution writes rows there
// (ReplayPlan.InboxRestore). So the statement first probes the primary key
// once for a row in the claimed range (taken). With none there, and the
// offsets strictly increasing ($8), a plain INSERT claims them all: it
// spares each row the ON CONFLICT arbiter's extra index probe and its
// speculative-insertion WAL record (about 50 of 350 bytes a row). With a row
// there, ON CONFLICT DO NOTHING skips the rows already handled, as claimSQL
// does. The primary key guards both: a row that appeared after the probe
// (no fenced writer can add one, as the fence holds the cursor row) fails
// the plain INSERT, and the transaction with it; nothing is applied twice.
const fenceAndClaimSQL = `
WITH fence AS (
  UPDATE kfn.cursors
     SET next_offset = $6, high_water = greatest(high_water, $6), updated_at = now()
   WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch = $4 AND next_offset = $5
  RETURNING 1
), lane AS (
  SELECT id FROM kfn.lanes WHERE consumer = $1 AND topic = $2 AND partition = $3
), taken AS (
  SELECT NOT $8::boolean OR EXISTS (
    SELECT FROM kfn.inbox
     WHERE lane = (SELECT id FROM lane)
       AND "offset" BETWEEN (SELECT min(o) FROM unnest($7::bigint[]) AS o) AND (SELECT max(o) FROM unnest($7::bigint[]) AS o)) AS held
), plain AS (
  INSERT INTO kfn.inbox (lane, "offset", epoch)
  SELECT (SELECT id FROM lane), o, $4 FROM unnest($7::bigint[]) AS o
   WHERE EXISTS (SELECT FROM fence) AND NOT (SELECT held FROM taken)
), claim AS (
  INSERT INTO kfn.inbox (lane, "offset", epoch)
  SELECT (SELECT id FROM lane), o, $4 FROM unnest($7::bigint[]) AS o
   WHERE EXISTS (SELECT FROM fence) AND (SELECT held FROM taken)
  ON CONFLICT DO NOTHING
  RETURNING "offset"
)
SELECT (SELECT count(*) FROM fence), (SELECT held FROM taken),
       coalesce((SELECT array_agg("offset" ORDER BY "offset") FROM claim), '{}')`

// QueueFenceAndClaim queues on b, for a transaction b begins
// (pgx.Batch.BeginTx), Advance (from `from` to `to` under token) and Claim
// (of offsets, as applied) as one statement, so that beginning the
// transaction, fencing and claiming take one round trip. Once b has been
// sent and closed, the returned function, given b's transaction, returns
// the offsets that were not in the inbox yet, in ascending order, or
// Advance's errors; when the cursor did not move nothing was claimed.
func QueueFenceAndClaim(b *pgx.Batch, p Partition, token, from, to int64, offsets []int64) func(context.Context, pgx.Tx) ([]int64, error) {
	if offsets == nil {
		offsets = []int64{}
	}
	increasing := true
	for i := 1; i < len(offsets); i++ {
		increasing = increasing && offsets[i] > offsets[i-1]
	}
	var moved int64
	var taken bool
	var fresh []int64
	scanned := false
	b.Queue(fenceAndClaimSQL, p.Consumer, p.Topic, p.Partition, token, from, to, offsets, increasing).QueryRow(func(row pgx.Row) error {
		if err := row.Scan(&moved, &taken, &fresh); err != nil {
			return fmt.Errorf("advance cursor of %s to %d and claim its inbox: %w", p, to, err)
		}
		scanned = true
		return nil
	})
	return func(ctx context.Context, tx pgx.Tx) ([]int64, error) {
		switch {
		case !scanned:
			return nil, fmt.Errorf("advance cursor of %s to %d and claim its inbox: the statement did not run", p, to)
		case moved == 0:
			return nil, advanceRefused(ctx, tx, p, token, from, to)
		case !taken:
			return offsets, nil // the plain INSERT claimed them all
		}
		return fresh, nil
	}
}

// CursorMovedError means the cursor is not where the caller moved it from,
// although the caller's token is still the partition's epoch: only the
// caller's own commit can have moved it (a new owner or a replay always
// brings a new token). Cursor is the stored cursor, to resume from.
type CursorMovedError struct {
	Partition Partition
	Token     int64
	From      int64 // where the caller thought the cursor was
	Cursor    Cursor
}

func (e *CursorMovedError) Error() string {
	return fmt.Sprintf("cursor of %s is at %d, not %d, under the same token %d: an earlier commit of this owner landed", e.Partition, e.Cursor.NextOffset, e.From, e.Token)
}

// SkipExpired moves the cursor from `from` to `to` over records Kafka deleted
// before anyone handled them, and records that in the audit log. It is the
// only way the cursor passes records that were neither applied nor
// dead-lettered, and it happens only when they no longer exist.
func SkipExpired(ctx context.Context, tx pgx.Tx, p Partition, token, from, to int64) error {
	if err := Advance(ctx, tx, p, token, from, to); err != nil {
		return err
	}
	return writeAudit(ctx, tx, "kfn-worker", "skip_expired", p, map[string]any{"from": from, "to": to, "epoch": token})
}

// ErrCannotEndOlderOwner means an older owner's open transaction holds the
// partition's cursor row and the caller's role may not end its session
// (neither the same role nor pg_signal_backend, or the older session is a
// superuser's): the claim waits until that transaction ends on its own.
var ErrCannotEndOlderOwner = errors.New("its cursor row is locked by an older owner's session that this role may not end")

// ErrOlderOwnerBlocked means an older owner's transaction held the cursor
// row and was ended; claiming again will succeed.
var ErrOlderOwnerBlocked = errors.New("an older owner's open transaction held the partition's cursor; its session was ended")

// TakeOver is ClaimPartition for a caller that holds the partition's lease
// with token, and that runs it as keyLanes key-lanes (1: as one lane); the
// claim writes their rows (see QueueFenceKeyLaneAndClaim) in its
// transaction. An older owner frozen between its fence and its COMMIT (a
// zombie: SIGSTOP, a long GC pause, a suspended VM) holds the cursor row's
// lock for as long as it sleeps, and the claim would wait behind it. After
// waiting wait, TakeOver ends that owner's session, which rolls its
// transaction back, and returns ErrOlderOwnerBlocked for the caller to
// retry. That is safe: the caller's newer lease means the older owner's has
// expired, and ending the session only discards work that never committed.
// It needs the privilege to signal the workers' sessions (the same role, or
// pg_signal_backend, which does not cover a superuser's sessions); without
// it, it returns an error wrapping ErrCannotEndOlderOwner, and the caller's
// retries wait until the older session ends on its own.
func TakeOver(ctx context.Context, db interface {
	Begin(context.Context) (pgx.Tx, error)
	Querier
}, p Partition, token int64, owner string, startOffset int64, keyLanes int, wait time.Duration) (Cursor, error) {
	return takeOver(ctx, db, p, token, wait, func(tx pgx.Tx) (Cursor, error) {
		c, err := ClaimPartition(ctx, tx, p, token, owner, startOffset)
		if err != nil {
			return Cursor{}, err
		}
		return c, claimKeyLanes(ctx, tx, p, token, keyLanes, c.NextOffset)
	})
}

// takeOver runs claim in a transaction whose lock waits end after wait,
// and ends the session of an older owner that held p's cursor row locked
// that long (see TakeOver).
func takeOver(ctx context.Context, db interface {
	Begin(context.Context) (pgx.Tx, error)
	Querier
}, p Partition, token int64, wait time.Duration, claim func(pgx.Tx) (Cursor, error)) (Cursor, error) {
	var c Cursor
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", wait.Milliseconds())); err != nil {
			return err
		}
		var err error
		c, err = claim(tx)
		return err
	})
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55P03" { // lock_not_available
		return c, err
	}
	// The older owner's transaction holds the cursor row, or the row of
	// one of its key-lanes.
	var ended int
	err = db.QueryRow(ctx, `
SELECT count(pg_terminate_backend(l.pid))
  FROM (SELECT xmax FROM kfn.cursors
         WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch < $4
        UNION
        SELECT xmax FROM kfn.key_lanes
         WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch < $4) c
  JOIN pg_locks l ON l.locktype = 'transactionid' AND l.transactionid = c.xmax AND l.granted AND l.pid <> pg_backend_pid()`,
		p.Consumer, p.Topic, p.Partition, token).Scan(&ended)
	if errors.As(err, &pgErr) && pgErr.Code == "42501" { // insufficient_privilege
		return Cursor{}, fmt.Errorf("claim %s: %w (waited %s; %s): run every worker as one role, or grant it pg_signal_backend (which cannot signal a superuser's sessions)", p, ErrCannotEndOlderOwner, wait, pgErr.Message)
	}
	if err != nil {
		return Cursor{}, fmt.Errorf("end the older owner's transaction on %s: %w", p, err)
	}
	if ended == 0 {
		return Cursor{}, fmt.Errorf("claim %s: its cursor row stayed locked for %s by a session that could not be ended (permission to signal it?)", p, wait)
	}
	return Cursor{}, fmt.Errorf("claim %s: %w", p, ErrOlderOwnerBlocked)
}
