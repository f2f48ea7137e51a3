package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// writeAudit appends one operator-visible action on a partition to
// kfn.audit_log inside tx: who did what, and the details (offsets, epoch,
// reason) as a JSON object.
func writeAudit(ctx context.Context, tx pgx.Tx, actor, action string, p Partition, details map[string]any) error {
	_, err := tx.Exec(ctx, `
INSERT INTO kfn.audit_log (actor, action, consumer, topic, partition, details) VALUES ($1, $2, $3, $4, $5, $6)`,
		actor, action, p.Consumer, p.Topic, p.Partition, details)
	if err != nil {
		return fmt.Errorf("audit %s of %s: %w", action, p, err)
	}
	return nil
}

// ActionClaim is the audit action of a partition claim. Its details hold
// the claim's epoch (the fencing token), its owner and lsn, the WAL insert
// position read inside the claim's transaction after it locked the
// partition's cursor row (see auditClaim), and the cursor's next_offset
// and high_water as the claim found them: from there on the partition is
// the claimer's, so an inbox row at or above both with an older epoch was
// committed by a fenced owner (kfn verify's fenced_but_committed).
const ActionClaim = "claim"

// auditClaim records, inside the claim's transaction tx, that owner claimed
// p with token. The row is the partition's epoch history: unlike the inbox,
// no retention deletes it, so a checker can tell at any time which token
// was current when a transaction of the partition committed.
//
// The lsn detail orders the claim among the partition's transactions. It is
// read after the claim's upsert, which holds the cursor row's lock until
// the transaction ends; every batch of the partition takes the same lock at
// its fence (the cursor UPDATE) before it writes anything. Two transactions
// holding one row lock in turn do not overlap, and the earlier one's COMMIT
// record is written before the later one can read the insert position, so a
// position read under the lock is strictly greater in the later one: by
// lsn, claims and fenced commits of one partition are in commit order.
//
// A partition run as key-lanes (KeyConcurrency > 1) commits records above
// its cursor too; the claim's upsert has written its epoch into their rows
// (the trigger kfn.fence_key_lanes), after every key-lane transaction in
// flight ended. key_lanes_reached is then the offset after the last record
// any of them committed: the older epochs committed nothing from there on.
func auditClaim(ctx context.Context, tx pgx.Tx, p Partition, token int64, owner string, c Cursor) error {
	var lsn string
	var reached *int64
	err := tx.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text,
       (SELECT max(next_offset) FROM kfn.key_lanes WHERE consumer = $1 AND topic = $2 AND partition = $3)`,
		p.Consumer, p.Topic, p.Partition).Scan(&lsn, &reached)
	if err != nil {
		return fmt.Errorf("audit claim of %s: read the WAL position: %w", p, err)
	}
	details := map[string]any{
		"epoch": token, "owner": owner, "lsn": lsn, "next_offset": c.NextOffset, "high_water": c.HighWater,
	}
	if reached != nil {
		details["key_lanes_reached"] = *reached
	}
	return writeAudit(ctx, tx, owner, ActionClaim, p, details)
}

// lockOwnedCursor reads and locks the partition's cursor inside tx, and
// checks that token is its epoch: only the holder of the partition's lease
// may move it.
func lockOwnedCursor(ctx context.Context, tx pgx.Tx, p Partition, token int64) (Cursor, error) {
	var c Cursor
	err := tx.QueryRow(ctx, `SELECT next_offset, high_water, generation, epoch, owner FROM kfn.cursors
 WHERE consumer = $1 AND topic = $2 AND partition = $3 FOR UPDATE`, p.Consumer, p.Topic, p.Partition).
		Scan(&c.NextOffset, &c.HighWater, &c.Generation, &c.Epoch, &c.Owner)
	if err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return Cursor{}, fmt.Errorf("partition %s has no cursor: nothing was ever processed there", p)
		}
		return Cursor{}, fmt.Errorf("read cursor of %s: %w", p, err)
	}
	if c.Epoch != token {
		return Cursor{}, &FencedError{Partition: p, Token: token, Epoch: c.Epoch}
	}
	return c, nil
}

// AuditEntry is one row of kfn.audit_log.
type AuditEntry struct {
	ID        int64
	At        time.Time
	Actor     string
	Action    string
	Partition Partition // an action on no single partition (a purge) has an empty consumer and topic and partition -1
	Details   json.RawMessage
}

// AuditFilter selects audit rows. Every field set narrows the selection.
type AuditFilter struct {
	Consumer      string
	Action        string
	NotAction     string // leave this action out (the claims, which would drown the rest)
	ActorContains string
	Since         time.Time // at or after
	Until         time.Time // before
	Limit         int       // the newest this many; 0: no limit
	Offset        int       // after leaving out the newest this many (a page further back)
}

// ReadAudit returns the audit rows f selects, oldest first; with a limit,
// the newest f.Limit of them after the newest f.Offset.
func ReadAudit(ctx context.Context, db Querier, f AuditFilter) ([]AuditEntry, error) {
	var w conditions
	if f.Consumer != "" {
		w.add("consumer = $?", f.Consumer)
	}
	if f.Action != "" {
		w.add("action = $?", f.Action)
	}
	if f.NotAction != "" {
		w.add("action <> $?", f.NotAction)
	}
	if f.ActorContains != "" {
		w.add("strpos(actor, $?) > 0", f.ActorContains)
	}
	if !f.Since.IsZero() {
		w.add("at >= $?", f.Since)
	}
	if !f.Until.IsZero() {
		w.add("at < $?", f.Until)
	}
	cond, args := w.clause()
	limit := ""
	if f.Limit > 0 {
		limit = " LIMIT " + strconv.Itoa(f.Limit)
	}
	if f.Offset > 0 {
		limit += " OFFSET " + strconv.Itoa(f.Offset)
	}
	rows, err := db.Query(ctx, `
SELECT id, at, actor, action, consumer, topic, partition, details::text FROM kfn.audit_log
 WHERE `+cond+` ORDER BY id DESC`+limit, args...)
	if err != nil {
		return nil, fmt.Errorf("read the audit log: %w", err)
	}
	entries, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (AuditEntry, error) {
		var e AuditEntry
		var details string
		err := r.Scan(&e.ID, &e.At, &e.Actor, &e.Action, &e.Partition.Consumer, &e.Partition.Topic, &e.Partition.Partition, &details)
		e.Details = json.RawMessage(details)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("read the audit log: %w", err)
	}
	slices.Reverse(entries)
	return entries, nil
}
