// Package effects is the test function and the checker behind kfn's
// exactly-once tests. The function records one row per applied record in a
// table with no unique key, so a duplicate apply shows up as a second row.
// Each row also carries what the checker needs to see through kfn's dedup
// layers: the fencing token its transaction committed with, whether that
// transaction held the lane's fence itself, and a commit-order value (the
// WAL insert position). The function emits one event per applied record,
// and it misbehaves on request (transient errors, permanent errors, panics)
// according to the record's value. The checker (Check) compares the
// effects, the dead letters, the partitions' claim history and the emitted
// events with what was produced.
package effects

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/runtime"
)

// Commands a record's value can carry. Anything else is applied as is.
const (
	Permanent  = "permanent" // fail permanently: dead-lettered at once
	Panic      = "panic"     // panic on every attempt: dead-lettered after the retries
	Always     = "always"    // fail on every attempt: dead-lettered after the retries
	FailPrefix = "fail-"     // "fail-N": fail the first N attempts, then succeed
	JSONPrefix = "{"         // must decode as JSON; malformed JSON is a permanent error
)

// Subject is the subject of the event emitted for each applied record.
func Subject(fn string) string { return "effects." + fn }

// Function returns a function named name that consumes topic and writes
// effects into table effects_<name>, one record at a time.
func Function(name, topic string) runtime.Function {
	return runtime.Function{
		Name:  name,
		Topic: topic,
		Emits: []string{Subject(name)},
		Setup: setup(name),
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			if err := apply(ctx, tx, name, rec); err != nil {
				return err
			}
			out.Emit(runtime.Event{Subject: Subject(name), Data: rec.Value})
			return nil
		},
	}
}

// BatchFunction is Function with a batch handler: one handler call per batch.
func BatchFunction(name, topic string) runtime.Function {
	return runtime.Function{
		Name:  name,
		Topic: topic,
		Emits: []string{Subject(name)},
		Setup: setup(name),
		BatchHandler: func(ctx context.Context, tx pgx.Tx, recs []runtime.Record, out *runtime.BatchEvents) error {
			for _, rec := range recs {
				if err := apply(ctx, tx, name, rec); err != nil {
					return err
				}
				out.Emit(rec, runtime.Event{Subject: Subject(name), Data: rec.Value})
			}
			return nil
		},
	}
}

func table(name string) string { return pgx.Identifier{"effects_" + name}.Sanitize() }

// The effects table. token is the lane's epoch as the handler's
// transaction saw it after kfn's fence; fenced says whether that
// transaction wrote the cursor row itself (it did if the fence, an UPDATE
// of the row under the token, ran in it); lsn is the commit-order value
// (see apply). Writers other than the test function (the naive baseline)
// leave token NULL and fenced false, and get lsn from the default.
func setup(name string) func(ctx context.Context, tx pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table(name)+` (
    id        bigserial PRIMARY KEY,
    topic     text    NOT NULL,
    partition integer NOT NULL,
    "offset"  bigint  NOT NULL,
    key       bytea,
    value     bytea,
    attempt   integer NOT NULL,
    token     bigint,
    fenced    boolean NOT NULL DEFAULT false,
    lsn       pg_lsn  NOT NULL DEFAULT pg_current_wal_insert_lsn()
)`)
		return err
	}
}

// apply misbehaves as the record's value asks, or records the effect.
func apply(ctx context.Context, tx pgx.Tx, name string, rec runtime.Record) error {
	v := string(rec.Value)
	switch {
	case v == Permanent:
		return runtime.Permanent(errors.New("asked to fail permanently"))
	case v == Panic:
		panic("asked to panic")
	case v == Always:
		return errors.New("asked to fail every time")
	case strings.HasPrefix(v, FailPrefix):
		n, err := strconv.Atoi(strings.TrimPrefix(v, FailPrefix))
		if err != nil {
			return runtime.Permanent(fmt.Errorf("bad fail count: %w", err))
		}
		if rec.Attempt <= n {
			return fmt.Errorf("transient failure %d of %d", rec.Attempt, n)
		}
	case strings.HasPrefix(v, JSONPrefix):
		var doc map[string]any
		if err := json.Unmarshal(rec.Value, &doc); err != nil {
			return runtime.Permanent(fmt.Errorf("decode JSON: %w", err))
		}
	}
	_, err := tx.Exec(ctx, insertSQL(name), rec.Topic, rec.Partition, rec.Offset, rec.Key, rec.Value, rec.Attempt, name)
	return err
}

// insertSQL writes one effect row together with the lane's fencing token
// and the commit-order value, read inside the handler's transaction.
//
// Token: kfn fences a batch with an UPDATE of the partition's cursor row
// under its token (epoch = T) before it calls the handler, in the same
// transaction. Reading the row afterwards in that transaction returns the
// row version the transaction wrote, so epoch is this transaction's token,
// and xmin equal to the transaction's own id proves it wrote the row (a
// batch that skipped its fence would read the committed epoch of someone
// else, and fenced would be false).
//
// A key-lane's transaction (KeyConcurrency > 1) fences itself on its
// key-lane's row in kfn.key_lanes instead, under the partition's token, and
// claims the record's inbox row with that token: its token is the inbox
// row's it wrote, and fenced says that it also wrote its key-lane's row,
// under that same epoch.
//
// Commit order: pg_current_wal_insert_lsn() is read after the fence, while
// the transaction holds the cursor row's lock (or its key-lane row's: then
// the order holds among the transactions of one key-lane, which hold all
// of a key's records), which it keeps until it ends. Every transaction of the partition takes that lock (batches at the
// fence, claims in their upsert), so two of them never hold it at the same
// time; the earlier one writes its COMMIT record before releasing it, so
// the later one reads a strictly greater insert position. Within one
// transaction each effect row's INSERT writes WAL before the next row reads
// the position, so rows of a batch grow too. Ordering one partition's
// effects and claims by lsn is therefore ordering them by commit. Across
// partitions the positions say nothing: transactions there overlap.
func insertSQL(name string) string {
	return `INSERT INTO ` + table(name) + ` (topic, partition, "offset", key, value, attempt, token, fenced, lsn)
SELECT $1::text, $2::integer, $3::bigint, $4::bytea, $5::bytea, $6::integer,
       CASE WHEN k.epoch IS NULL THEN c.epoch ELSE i.epoch END,
       CASE WHEN k.epoch IS NULL THEN coalesce(c.xmin = pg_current_xact_id()::xid, false) ELSE k.epoch = i.epoch END,
       pg_current_wal_insert_lsn()
  FROM (VALUES (1)) AS one (x)
  LEFT JOIN kfn.cursors c ON c.consumer = $7::text AND c.topic = $1::text AND c.partition = $2::integer
  LEFT JOIN kfn.key_lanes k ON k.consumer = $7::text AND k.topic = $1::text AND k.partition = $2::integer
                           AND k.xmin = pg_current_xact_id()::xid
  LEFT JOIN kfn.lanes l ON l.consumer = $7::text AND l.topic = $1::text AND l.partition = $2::integer
  LEFT JOIN kfn.inbox i ON i.lane = l.id AND i."offset" = $3::bigint AND i.xmin = pg_current_xact_id()::xid`
}
