package schema

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Migration 0012 replaces kfn.inbox, keyed by (consumer, topic,
// partition, offset), with a table keyed by (lane, offset). Copying the
// rows in the migration's transaction holds the old table for as long as
// the copy takes, and every worker stands still meanwhile
// (BenchmarkMigration12). So on an installation migrated before, whose
// workers built for schema 11 may be running, Migrate first copies the
// inbox online:
//
//  1. One short transaction runs the part of 0012 above its
//     onlinePrepareEnd line (the new tables, each made only if missing)
//     and puts statement triggers on the old kfn.inbox that mirror every
//     INSERT, UPDATE, DELETE and TRUNCATE into kfn.inbox_compact, adding
//     a lane when one is new (mirrorInboxSQL). Old workers keep writing
//     the old columns.
//  2. The rows that were there before are copied in batches, each in a
//     transaction of its own, in the old primary key's order.
//     kfn.inbox_backfill records the last key copied, so a copy that was
//     interrupted (the migrator killed) goes on where it stopped when
//     kfn migrate runs again, and then that the copy finished.
//  3. Migration 0012 itself then locks the old table, finds the copy
//     finished and swaps the tables without reading them: the old workers
//     stand still for the swap only, and then fail.
//
// Why the new table ends up holding exactly the old one's rows:
//   - A transaction that writes kfn.inbox holds a lock that conflicts with
//     the triggers' creation. So a write committed before the triggers is
//     seen by every snapshot of the copy, all taken after the triggers'
//     transaction committed, and every later write runs the triggers.
//   - The copy goes up to the greatest key there was once the triggers
//     were in: a row above it was written later, and is mirrored.
//   - A row copied while a write of it is mirrored: the copy inserts with
//     ON CONFLICT DO NOTHING and the mirror upserts, so the write's epoch,
//     outcome and time win in either order, even when the copy read the
//     row before the write (an UPDATE of a row not copied yet inserts its
//     mirror, and the copy leaves it).
//   - A row deleted while the copy reads it (retention's purge, the
//     release of a re-execution, kfn replay): the copy locks the rows it
//     copies FOR KEY SHARE, which a DELETE waits for and an INSERT or an
//     UPDATE of the outcome does not. Either the DELETE committed first,
//     and the copy skips the row, or the copy did, and the DELETE's
//     trigger, whose statement takes a later snapshot, deletes the copy.
//     Without the lock a copy could outlive its row: harmless after a
//     retention purge (the cursor's high-water mark blocks that offset
//     anyway, and retention deletes the copy later), but the offsets a
//     re-execution released would stay blocked. A DELETE waits for at
//     most one batch's transaction.
//   - That reasoning holds for writers at READ COMMITTED, which every kfn
//     worker and command uses: in a REPEATABLE READ transaction the
//     trigger's DELETE would not see a copy committed after that
//     transaction's snapshot.
//   - A batch and a worker can deadlock (a worker that writes two rows of
//     the batch, in the other order, in one transaction). Postgres aborts
//     one of them: the worker retries its transaction, the copy its batch.
//   - A TRUNCATE of kfn.inbox truncates the copy too.
//
// The triggers run as the role of the statement that fires them, a
// worker's, which may have no right on the new tables (0011's function
// roles): their function is SECURITY DEFINER, owned by the migrator, with
// a fixed search_path and schema-qualified names.

// compactInboxVersion is the migration that is prepared online.
const compactInboxVersion = 12

// onlinePrepareEnd ends the part of migration 0012 that the online copy
// runs ahead, in the transaction that adds the triggers.
const onlinePrepareEnd = "-- kfn:online-prepare ends"

// backfillRows is how many old rows each of the copy's transactions
// copies: about a fifth of a second of work.
const backfillRows = 10_000

// The statements that lock kfn.inbox (adding the triggers, the swap) wait
// for the lock lockWait at the most, and are tried lockAttempts times: a
// lock request that waits blocks every later writer of the table, so a
// long transaction on the inbox must not make the workers wait as long.
const (
	lockWait     = 3 * time.Second
	lockAttempts = 20
)

// mirrorInboxSQL adds the triggers that mirror kfn.inbox into
// kfn.inbox_compact. Each statement's rows are mirrored by a few
// set-based statements (transition tables), not one call per row: a
// worker's claim of a batch pays two statements more, not one per record.
const mirrorInboxSQL = `
CREATE OR REPLACE FUNCTION kfn.inbox_mirror() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        TRUNCATE kfn.inbox_compact;
        RETURN NULL;
    END IF;
    IF TG_OP = 'DELETE' THEN
        DELETE FROM kfn.inbox_compact c
         USING old_rows o
          JOIN kfn.lanes l ON l.consumer = o.consumer AND l.topic = o.topic AND l.partition = o.partition
         WHERE c.lane = l.id AND c."offset" = o."offset";
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' THEN
        -- kfn never changes a row's key, but a row whose key changed
        -- leaves its old key.
        DELETE FROM kfn.inbox_compact c
         USING old_rows o
          JOIN kfn.lanes l ON l.consumer = o.consumer AND l.topic = o.topic AND l.partition = o.partition
         WHERE c.lane = l.id AND c."offset" = o."offset"
           AND NOT EXISTS (SELECT FROM new_rows n
                            WHERE n.consumer = o.consumer AND n.topic = o.topic AND n.partition = o.partition AND n."offset" = o."offset");
    END IF;
    -- INSERT and UPDATE. The lanes first: the next statement's snapshot
    -- sees them, and a lane another transaction is adding too (the
    -- conflict waits for it).
    INSERT INTO kfn.lanes (consumer, topic, partition)
    SELECT DISTINCT n.consumer, n.topic, n.partition FROM new_rows n
     WHERE NOT EXISTS (SELECT FROM kfn.lanes l WHERE l.consumer = n.consumer AND l.topic = n.topic AND l.partition = n.partition)
    ON CONFLICT DO NOTHING;
    INSERT INTO kfn.inbox_compact ("offset", epoch, processed_at, lane, outcome)
    SELECT n."offset", n.epoch, n.processed_at, l.id, n.outcome::kfn.outcome
      FROM new_rows n
      JOIN kfn.lanes l ON l.consumer = n.consumer AND l.topic = n.topic AND l.partition = n.partition
    ON CONFLICT (lane, "offset") DO UPDATE
       SET epoch = EXCLUDED.epoch, processed_at = EXCLUDED.processed_at, outcome = EXCLUDED.outcome;
    RETURN NULL;
END;
$$;
-- Fired by triggers only, which check no EXECUTE right.
REVOKE ALL ON FUNCTION kfn.inbox_mirror() FROM PUBLIC;

DROP TRIGGER IF EXISTS inbox_mirror_insert ON kfn.inbox;
DROP TRIGGER IF EXISTS inbox_mirror_update ON kfn.inbox;
DROP TRIGGER IF EXISTS inbox_mirror_delete ON kfn.inbox;
DROP TRIGGER IF EXISTS inbox_mirror_truncate ON kfn.inbox;
CREATE TRIGGER inbox_mirror_insert AFTER INSERT ON kfn.inbox
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION kfn.inbox_mirror();
CREATE TRIGGER inbox_mirror_update AFTER UPDATE ON kfn.inbox
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION kfn.inbox_mirror();
CREATE TRIGGER inbox_mirror_delete AFTER DELETE ON kfn.inbox
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION kfn.inbox_mirror();
CREATE TRIGGER inbox_mirror_truncate AFTER TRUNCATE ON kfn.inbox
    FOR EACH STATEMENT EXECUTE FUNCTION kfn.inbox_mirror();`

// batchRangesSQL adds the lanes of the next batch, the rows after $1..$4
// up to $5..$8 at the most, $9 of them, and returns the batch as ranges of
// offsets, one for each partition it has rows of, in key order (no row
// when none is left). The batch's ranges are fixed here, before the copy
// locks a row: a locked row that changed is read again, and a batch whose
// end came from the rows it locked could skip keys. A row of schema 11 in
// such a range that is not in this snapshot was written later, and is
// mirrored.
const batchRangesSQL = `
WITH batch AS (
    SELECT consumer, topic, partition, "offset" FROM kfn.inbox
     WHERE (consumer, topic, partition, "offset") > ($1, $2, $3, $4)
       AND (consumer, topic, partition, "offset") <= ($5, $6, $7, $8)
     ORDER BY consumer, topic, partition, "offset"
     LIMIT $9
), lanes AS (
    INSERT INTO kfn.lanes (consumer, topic, partition)
    SELECT DISTINCT b.consumer, b.topic, b.partition FROM batch b
     WHERE NOT EXISTS (SELECT FROM kfn.lanes l WHERE l.consumer = b.consumer AND l.topic = b.topic AND l.partition = b.partition)
     ORDER BY 1, 2, 3
    ON CONFLICT DO NOTHING
)
SELECT consumer, topic, partition, min("offset"), max("offset") FROM batch
 GROUP BY consumer, topic, partition
 ORDER BY consumer, topic, partition`

// copyRangeSQL copies the rows of one partition ($1, $2, $3) from offset
// $4 to $5 and counts those it inserted as copied. Its equalities bound the
// primary key's scan; a row comparison does not as an upper bound (a
// btree scan stops on a row comparison's first column only), which made
// each batch read to the end of its consumer's rows. A row with no lane
// would be a NULL lane, refused: never skipped.
const copyRangeSQL = `
WITH batch AS (
    SELECT "offset", epoch, outcome, processed_at FROM kfn.inbox
     WHERE consumer = $1 AND topic = $2 AND partition = $3 AND "offset" BETWEEN $4 AND $5
       FOR KEY SHARE
), copied AS (
    INSERT INTO kfn.inbox_compact ("offset", epoch, processed_at, lane, outcome)
    SELECT b."offset", b.epoch, b.processed_at,
           (SELECT id FROM kfn.lanes WHERE consumer = $1 AND topic = $2 AND partition = $3), b.outcome::kfn.outcome
      FROM batch b
     ORDER BY b."offset"
    ON CONFLICT DO NOTHING
    RETURNING 1
)
UPDATE kfn.inbox_backfill SET copied = copied + (SELECT count(*) FROM copied)`

// copiedSQL records, in the batch's transaction, that the rows up to
// $1..$4 are copied, and returns how many rows are copied in all.
const copiedSQL = `UPDATE kfn.inbox_backfill SET consumer = $1, topic = $2, partition = $3, "offset" = $4 RETURNING copied`

// inboxKey is a primary key of the old kfn.inbox.
type inboxKey struct {
	consumer, topic string
	partition       int32
	offset          int64
}

func (k inboxKey) args() []any { return []any{k.consumer, k.topic, k.partition, k.offset} }

// prepareCompactInbox copies kfn.inbox into kfn.inbox_compact online, for
// migration m (0012), on conn, which holds the migration lock.
func prepareCompactInbox(ctx context.Context, conn *pgx.Conn, m Migration, o migrateOptions) error {
	shadow, _, ok := strings.Cut(m.SQL, onlinePrepareEnd)
	if !ok {
		return fmt.Errorf("migration %s has no line %q", m.Name, onlinePrepareEnd)
	}
	_, err := lockingTx(ctx, conn, m, o, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, shadow); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, mirrorInboxSQL)
		return err
	})
	if err != nil {
		return fmt.Errorf("mirror kfn.inbox into kfn.inbox_compact: %w", err)
	}
	o.report(Progress{Migration: m.Name, Step: StepMirroring})
	if err := backfillInbox(ctx, conn, m.Name, o); err != nil {
		return fmt.Errorf("copy kfn.inbox into kfn.inbox_compact: %w", err)
	}
	return nil
}

// backfillInbox copies the rows of kfn.inbox, from where an earlier run
// stopped, and records that the copy finished.
func backfillInbox(ctx context.Context, conn *pgx.Conn, migration string, o migrateOptions) error {
	var from inboxKey
	var copied int64
	var done bool
	err := conn.QueryRow(ctx, `SELECT consumer, topic, partition, "offset", copied, done FROM kfn.inbox_backfill`).
		Scan(&from.consumer, &from.topic, &from.partition, &from.offset, &copied, &done)
	if err != nil {
		return err
	}
	p := Progress{Migration: migration, Step: StepCopying, Rows: copied, Resumed: copied}
	if done {
		p.Step = StepCopied
		o.report(p)
		return nil
	}
	// Postgres' statistics; none before the table was ever analyzed.
	if err := conn.QueryRow(ctx, `SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = 'kfn.inbox'::regclass`).Scan(&p.Estimate); err != nil {
		return err
	}
	// The greatest key now that the triggers are in: a row above it was
	// written since, and is mirrored.
	var upTo inboxKey
	err = conn.QueryRow(ctx, `SELECT consumer, topic, partition, "offset" FROM kfn.inbox
	                           ORDER BY consumer DESC, topic DESC, partition DESC, "offset" DESC LIMIT 1`).
		Scan(&upTo.consumer, &upTo.topic, &upTo.partition, &upTo.offset)
	if errors.Is(err, pgx.ErrNoRows) {
		upTo = from // an empty inbox: nothing to copy
	} else if err != nil {
		return err
	}
	start := time.Now()
	for {
		end, more, err := copyBatch(ctx, conn, from, upTo, o.batchRows(), &p.Rows)
		if err != nil {
			return fmt.Errorf("copy the rows after %s/%s/%d@%d: %w", from.consumer, from.topic, from.partition, from.offset, err)
		}
		p.Elapsed = time.Since(start)
		if !more {
			break
		}
		from = end
		o.report(p)
	}
	if _, err := conn.Exec(ctx, `UPDATE kfn.inbox_backfill SET done = true`); err != nil {
		return err
	}
	p.Step, p.Elapsed = StepCopied, time.Since(start)
	o.report(p)
	return nil
}

// copyBatch copies the next batch after from, up to upTo, in a
// transaction, sets *copied to the rows copied in all, and returns the
// batch's last key; more is false when no row was left. A batch that
// deadlocked with a worker is tried again.
func copyBatch(ctx context.Context, conn *pgx.Conn, from, upTo inboxKey, rows int, copied *int64) (end inboxKey, more bool, err error) {
	type span struct {
		inboxKey       // the partition, and the range's last offset
		first    int64 // its first offset
	}
	for attempt := 1; ; attempt++ {
		err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			ranges, err := tx.Query(ctx, batchRangesSQL, append(append(from.args(), upTo.args()...), rows)...)
			if err != nil {
				return err
			}
			spans, err := pgx.CollectRows(ranges, func(row pgx.CollectableRow) (span, error) {
				var s span
				err := row.Scan(&s.consumer, &s.topic, &s.partition, &s.first, &s.offset)
				return s, err
			})
			if more = len(spans) > 0; err != nil || !more {
				return err
			}
			end = spans[len(spans)-1].inboxKey
			b := &pgx.Batch{}
			for _, s := range spans {
				b.Queue(copyRangeSQL, s.consumer, s.topic, s.partition, s.first, s.offset)
			}
			b.Queue(copiedSQL, end.args()...).QueryRow(func(row pgx.Row) error {
				return row.Scan(copied)
			})
			return tx.SendBatch(ctx, b).Close()
		})
		var pgErr *pgconn.PgError
		if attempt < 5 && errors.As(err, &pgErr) && (pgErr.Code == "40P01" || pgErr.Code == "40001") { // deadlock_detected, serialization_failure
			continue
		}
		return end, more, err
	}
}

// lockingTx runs fn in a transaction of conn whose every lock wait lasts
// lockWait at the most. When one gives up (another transaction holds a
// table fn locks), it reports StepWaiting and tries again, lockAttempts
// times in all. It returns how long the transaction that committed took.
func lockingTx(ctx context.Context, conn *pgx.Conn, m Migration, o migrateOptions, fn func(pgx.Tx) error) (time.Duration, error) {
	for attempt := 1; ; attempt++ {
		start := time.Now()
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprint(o.lockTimeout().Milliseconds())); err != nil {
				return err
			}
			return fn(tx)
		})
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "55P03" { // lock_not_available
			return time.Since(start), err
		}
		if attempt == lockAttempts {
			return 0, fmt.Errorf("another transaction held kfn.inbox through %d waits of %s (find it in pg_stat_activity, and run kfn migrate again): %w", lockAttempts, o.lockTimeout(), err)
		}
		o.report(Progress{Migration: m.Name, Step: StepWaiting, Attempt: attempt})
	}
}
