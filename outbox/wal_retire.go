package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Retiring the WAL outbox (`kfn migrate --drop-wal-outbox`) after the
// workers went back to ModeTable takes three steps, each safe to run
// again:
//
//  1. RetireWAL marks it retired under the table's ACCESS EXCLUSIVE lock.
//     kfn.emit_events reads kfn.wal_outbox, so every transaction that
//     called it holds ACCESS SHARE on the table until it ends: the lock
//     waits for all of them, and the WAL insert position taken under it
//     (retired_lsn) lies past every event ever committed. A transaction
//     that calls emit_events afterwards waits for the lock, then (at READ
//     COMMITTED, Postgres's default, which workers use) sees the
//     retirement and is refused with SQLSTATE 55000, which workers retry
//     and never dead-letter. At REPEATABLE READ a transaction whose
//     snapshot predates the retirement would not see it: emitting
//     transactions must not run at that level.
//  2. The relays keep reading the slot (a retired outbox is still set
//     up) until its confirmed position passes retired_lsn: every event
//     is then acked by the stream (WALState.Drained).
//  3. DropRetiredWAL deletes the row, ends the slot's walsender, and
//     drops the slot and the publication, in one transaction whose row
//     lock keeps a relay from fencing the slot again meanwhile. A relay
//     then finds the WAL outbox retired or not set up, which is not slot
//     loss: it logs nothing louder than debug and looks again only every
//     RetryMax (a later SetUpWAL is read again).

// ErrWALRetired is an emit, or a worker in ModeWAL, refused because the
// WAL outbox is retired.
var ErrWALRetired = errors.New("the WAL outbox is retired: run the workers with --outbox table")

// ErrWALNotDrained is a retired WAL outbox whose slot still holds events
// emitted before the retirement that the relay has not confirmed.
var ErrWALNotDrained = errors.New("the retired WAL outbox's slot is not drained")

// RetireWAL retires the WAL outbox of pool's database (step 1 above),
// waiting up to lockWait for the transactions that emitted to end, and
// returns its state; a retired one is returned as it is. ErrWALNotSetUp
// when there is none.
func RetireWAL(ctx context.Context, pool *pgxpool.Pool, lockWait time.Duration) (WALState, error) {
	before, err := ReadWALState(ctx, pool)
	switch {
	case err != nil:
		return before, err
	case !before.SetUp:
		return before, ErrWALNotSetUp
	case !before.RetiredAt.IsZero():
		return before, nil
	}
	var role string
	// The lock request queues every reader of kfn.wal_outbox (kfn status,
	// the metrics, the relay's report, new emits) behind it while it waits:
	// it waits lockAttempt at a time and lets them through in between.
	deadline := time.Now().Add(lockWait)
	for {
		attempt := min(time.Until(deadline), lockAttempt)
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if err := tx.QueryRow(ctx, `SELECT current_user`).Scan(&role); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, fmt.Sprintf(`SET LOCAL lock_timeout = %d`, max(attempt.Milliseconds(), 1))); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `LOCK TABLE kfn.wal_outbox IN ACCESS EXCLUSIVE MODE`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `UPDATE kfn.wal_outbox SET retired_at = coalesce(retired_at, now()), retired_lsn = coalesce(retired_lsn, pg_current_wal_insert_lsn())`)
			return err
		})
		if !isLockTimeout(err) || time.Until(deadline) <= 0 {
			break
		}
		if !sleepCtx(ctx, 50*time.Millisecond) {
			return before, ctx.Err()
		}
	}
	if isLockTimeout(err) {
		return before, fmt.Errorf("retire the WAL outbox: transactions that emitted into the WAL did not end within %s (see pg_locks on kfn.wal_outbox); run it again when they have, or with a longer --wait: %w", lockWait, err)
	}
	if err != nil {
		return before, privilegeError(err, role, "retire the WAL outbox", "UPDATE on kfn.wal_outbox")
	}
	return ReadWALState(ctx, pool)
}

// lockAttempt bounds each wait for RetireWAL's lock.
const lockAttempt = time.Second

func isLockTimeout(err error) bool { return pgErrorCode(err) == "55P03" }

// pgErrorCode is the SQLSTATE of a Postgres error in err's chain; "" if none.
func pgErrorCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// WALDrop is what DropRetiredWAL dropped.
type WALDrop struct {
	Slot, Publication string
	// SlotDropped is false when the slot was gone already.
	SlotDropped bool
	// Terminated is the pid of the walsender it ended; 0 if none read the slot.
	Terminated int
}

// DropRetiredWAL drops the retired, drained WAL outbox (step 3 above),
// leaving the database as if it had never been set up. It changes
// nothing and returns ErrWALNotSetUp when there is none, an error saying
// to retire it first when it is not retired, and ErrWALNotDrained when
// its slot still holds events from before the retirement. A missing
// right is named in the error.
func DropRetiredWAL(ctx context.Context, pool *pgxpool.Pool) (WALDrop, error) {
	var out WALDrop
	var role string
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `SELECT current_user`).Scan(&role); err != nil {
			return err
		}
		var retired bool
		var left *int64
		err := tx.QueryRow(ctx, `
DELETE FROM kfn.wal_outbox w RETURNING w.slot_name, w.publication, w.retired_at IS NOT NULL,
       (SELECT (w.retired_lsn - s.confirmed_flush_lsn)::bigint FROM pg_replication_slots s WHERE s.slot_name = w.slot_name AND s.database = current_database())`).Scan(
			&out.Slot, &out.Publication, &retired, &left)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return ErrWALNotSetUp
		case err != nil:
			return privilegeError(err, role, "drop the WAL outbox", "DELETE on kfn.wal_outbox")
		case !retired:
			return errors.New("the WAL outbox is not retired: retire it first (kfn migrate --drop-wal-outbox does both)")
		case left != nil && *left > 0:
			return fmt.Errorf("%w: %d bytes of WAL from before the retirement are not confirmed by a relay", ErrWALNotDrained, *left)
		}
		return dropSlot(ctx, tx, role, &out)
	})
	return out, err
}

// dropSlot ends the walsender on out.Slot, drops it and the publication.
func dropSlot(ctx context.Context, tx pgx.Tx, role string, out *WALDrop) error {
	// A relay's walsender holds the slot until it has exited: end it, and
	// wait. The row lock taken by the caller's DELETE keeps its relay from
	// fencing the slot again before the drop commits.
	for deadline := time.Now().Add(10 * time.Second); ; {
		var exists bool
		var active int
		err := tx.QueryRow(ctx, `SELECT count(*) > 0, coalesce(max(active_pid), 0) FROM pg_replication_slots WHERE slot_name = $1`, out.Slot).Scan(&exists, &active)
		if err != nil {
			return fmt.Errorf("read the slot %s: %w", out.Slot, err)
		}
		if !exists {
			break
		}
		if active == 0 {
			if _, err := tx.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, out.Slot); err != nil {
				if pgErrorCode(err) == "55006" && time.Now().Before(deadline) { // taken again by a walsender just now
					time.Sleep(20 * time.Millisecond)
					continue
				}
				return privilegeError(err, role, "drop the replication slot "+out.Slot, "REPLICATION")
			}
			out.SlotDropped = true
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("drop the replication slot %s: its walsender (pid %d) did not exit within 10s of being terminated", out.Slot, active)
		}
		if out.Terminated != active {
			if _, err := tx.Exec(ctx, `SELECT pg_terminate_backend($1)`, active); err != nil {
				return privilegeError(err, role, fmt.Sprintf("end the walsender (pid %d) reading the slot %s", active, out.Slot), "pg_signal_backend, or membership in the relay's role")
			}
			out.Terminated = active
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := tx.Exec(ctx, `DROP PUBLICATION IF EXISTS `+pgx.Identifier{out.Publication}.Sanitize()); err != nil {
		return privilegeError(err, role, "drop the publication "+out.Publication, "ownership of the publication")
	}
	return nil
}

// retiredSlotGone reports whether the WAL outbox a relay found without
// its slot is retired: the slot went with `kfn migrate --drop-wal-outbox`
// once drained, which is not slot loss.
func retiredSlotGone(ctx context.Context, conn *pgconn.PgConn) bool {
	rows, err := simpleQuery(ctx, conn, `SELECT retired_at IS NOT NULL FROM kfn.wal_outbox`)
	return err == nil && len(rows) == 1 && rows[0][0] == "t"
}
