package outbox

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Mode is where a function's transaction writes its events.
type Mode string

const (
	// ModeTable writes them as kfn.outbox rows, which the relay reads by
	// shard and deletes once the stream has acked them. The default.
	ModeTable Mode = "table"
	// ModeWAL writes them into the WAL as logical decoding messages
	// (pg_logical_emit_message), which the relay reads from a logical
	// replication slot: no table row, no index entry, no delete, no vacuum.
	// Postgres needs wal_level=logical, and `kfn migrate --outbox wal` must
	// have created the slot (see WALRelay in the package doc).
	ModeWAL Mode = "wal"
)

// ParseMode reads a mode's name; "" is ModeTable.
func ParseMode(s string) (Mode, error) {
	switch Mode(s) {
	case "", ModeTable:
		return ModeTable, nil
	case ModeWAL:
		return ModeWAL, nil
	}
	return "", fmt.Errorf("%q is not an outbox mode: use table or wal", s)
}

const emitSQL = `SELECT kfn.emit_events($1::bytea[])`

// QueueWrite queues on b the statement that writes rows in mode, in slice
// order: the kfn.outbox INSERT (QueueInsert), or one call of
// kfn.emit_events with every row's logical decoding message. Nothing when
// rows is empty. A caller pipelines it with its COMMIT.
func QueueWrite(b *pgx.Batch, mode Mode, rows []Row) {
	if len(rows) == 0 {
		return
	}
	if mode != ModeWAL {
		QueueInsert(b, rows)
		return
	}
	now := time.Now().Truncate(time.Microsecond)
	payloads := make([][]byte, len(rows))
	for i, r := range rows {
		payloads[i] = encodeWALEvent(nil, r, now)
	}
	b.Queue(emitSQL, payloads)
}

// Write writes rows in mode inside tx, in one round trip (see QueueWrite).
func Write(ctx context.Context, tx pgx.Tx, mode Mode, rows []Row) error {
	if mode != ModeWAL {
		return Insert(ctx, tx, rows)
	}
	if len(rows) == 0 {
		return nil
	}
	b := &pgx.Batch{}
	QueueWrite(b, mode, rows)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("emit %d events into the WAL: %w", len(rows), err)
	}
	return nil
}

// WALPublication is the publication the WAL outbox's slot is read with.
// It publishes no table: pgoutput sends the logical decoding messages
// (messages 'true') whatever the publication holds.
const WALPublication = "kfn_outbox"

// WALSlotName is the name of the WAL outbox's replication slot for
// database: "kfn_outbox_" and the database's name in lower-case letters,
// digits and underscores (slots are named per cluster, so two databases
// of one cluster get two slots), cut with a hash of the name when long.
func WALSlotName(database string) string {
	clean := strings.Map(func(c rune) rune {
		switch {
		case 'a' <= c && c <= 'z', '0' <= c && c <= '9', c == '_':
			return c
		case 'A' <= c && c <= 'Z':
			return c + 'a' - 'A'
		}
		return '_'
	}, database)
	name := "kfn_outbox_" + clean
	if len(name) <= 63 && clean == database {
		return name
	}
	h := fnv.New32a()
	h.Write([]byte(database))
	suffix := fmt.Sprintf("_%08x", h.Sum32())
	return name[:min(len(name), 63-len(suffix))] + suffix
}

var slotNamePattern = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// ErrWALLevel is a Postgres server whose wal_level is not logical: it
// cannot decode the WAL outbox's messages.
var ErrWALLevel = errors.New("the WAL outbox needs wal_level=logical")

// ErrWALNotSetUp is a database whose WAL outbox has no slot yet.
var ErrWALNotSetUp = errors.New("the WAL outbox is not set up in this database: run `kfn migrate --outbox wal`")

// ErrSlotLost is a WAL outbox whose replication slot was dropped (or
// invalidated) after it was created: events that were written and not
// yet relayed then are lost, and new events are refused until
// `kfn migrate --outbox wal` creates the slot again.
var ErrSlotLost = errors.New("the WAL outbox's replication slot is gone")

// CheckWALLevel returns ErrWALLevel (with the server's setting) unless
// the server has wal_level=logical.
func CheckWALLevel(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) error {
	var level string
	if err := db.QueryRow(ctx, "SHOW wal_level").Scan(&level); err != nil {
		return fmt.Errorf("read wal_level: %w", err)
	}
	if level != "logical" {
		return fmt.Errorf("%w, and this server has wal_level=%s: set wal_level = logical (postgresql.conf, or the managed service's parameter; it takes a restart) or run with --outbox table", ErrWALLevel, level)
	}
	return nil
}

// WALState is the WAL outbox of a database as kfn.wal_outbox and
// pg_replication_slots describe it.
type WALState struct {
	SetUp       bool   // kfn.wal_outbox has its row
	Slot        string // the slot's name
	Publication string
	SlotExists  bool // the slot is in pg_replication_slots
	// SlotStatus is the slot's wal_status (reserved, extended, unreserved,
	// lost: lost means max_slot_wal_keep_size removed WAL it needed).
	SlotStatus string
	ActivePID  int // the walsender reading the slot; 0 if none
	// LagBytes is the WAL between the slot's confirmed position and the
	// server's current one: what the slot holds back.
	LagBytes int64
	// Pending and OldestPending are the reader's last report: events read
	// and not yet acked by the stream, and the oldest one's emit time.
	Pending       int64
	OldestPending time.Time
	ConfirmedAt   time.Time // when the reader last confirmed a position
	ReportedAt    time.Time // when the reader last reported
	Reader        string    // the reader's worker id
	FenceToken    int64
	LostAt        time.Time // when a reader found the slot gone
	// RetiredAt is when `kfn migrate --drop-wal-outbox` retired it (zero
	// if not): emits are refused since. RetireLeftBytes is the WAL from
	// the slot's confirmed position up to the retirement's: what the
	// relay has still to read and ack before the slot may be dropped.
	RetiredAt       time.Time
	RetireLeftBytes int64
}

// Lost reports whether the slot was set up and is gone or unusable. A
// retired WAL outbox is never lost: its slot goes when it is drained.
func (s WALState) Lost() bool {
	return s.SetUp && s.RetiredAt.IsZero() && (!s.SlotExists || s.SlotStatus == "lost")
}

// Drained reports whether the WAL outbox is retired and its slot holds
// no event from before the retirement that the stream has not acked (or
// the slot is gone already).
func (s WALState) Drained() bool {
	return s.SetUp && !s.RetiredAt.IsZero() && (!s.SlotExists || s.RetireLeftBytes <= 0)
}

// ReadWALState reads the database's WAL outbox state. A database
// migrated before the WAL outbox existed reads as not set up.
func ReadWALState(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (WALState, error) {
	var s WALState
	var exists bool
	if err := db.QueryRow(ctx, `SELECT to_regclass('kfn.wal_outbox') IS NOT NULL`).Scan(&exists); err != nil {
		return s, fmt.Errorf("read the WAL outbox state: %w", err)
	}
	if !exists {
		return s, nil
	}
	var status, reader *string
	var pid *int32
	var lag *int64
	var oldest, confirmed, reported, lost, retired *time.Time
	var retireLeft *int64
	err := db.QueryRow(ctx, `
SELECT w.slot_name, w.publication, s.slot_name IS NOT NULL, s.wal_status, s.active_pid,
       (pg_current_wal_lsn() - coalesce(s.confirmed_flush_lsn, pg_current_wal_lsn()))::bigint,
       w.pending_events, w.oldest_pending, w.confirmed_at, w.reported_at, w.reader, w.fence_token, w.lost_at,
       w.retired_at, (w.retired_lsn - coalesce(s.confirmed_flush_lsn, s.restart_lsn))::bigint
  FROM kfn.wal_outbox w
  LEFT JOIN pg_replication_slots s ON s.slot_name = w.slot_name AND s.database = current_database()`).Scan(
		&s.Slot, &s.Publication, &s.SlotExists, &status, &pid, &lag,
		&s.Pending, &oldest, &confirmed, &reported, &reader, &s.FenceToken, &lost, &retired, &retireLeft)
	if errors.Is(err, pgx.ErrNoRows) {
		return s, nil
	}
	if err != nil {
		return s, fmt.Errorf("read the WAL outbox state: %w", err)
	}
	s.SetUp = true
	s.SlotStatus = deref(status)
	s.Reader = deref(reader)
	if pid != nil {
		s.ActivePID = int(*pid)
	}
	if lag != nil {
		s.LagBytes = *lag
	}
	s.OldestPending, s.ConfirmedAt, s.ReportedAt, s.LostAt = deref(oldest), deref(confirmed), deref(reported), deref(lost)
	s.RetiredAt, s.RetireLeftBytes = deref(retired), deref(retireLeft)
	return s, nil
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

// CheckWAL checks that a worker may write events with ModeWAL: the server
// has wal_level=logical and the WAL outbox is set up, with its slot.
func CheckWAL(ctx context.Context, pool *pgxpool.Pool) error {
	if err := CheckWALLevel(ctx, pool); err != nil {
		return err
	}
	s, err := ReadWALState(ctx, pool)
	if err != nil {
		return err
	}
	switch {
	case !s.SetUp:
		return ErrWALNotSetUp
	case !s.RetiredAt.IsZero():
		return fmt.Errorf("%w (retired %s by kfn migrate --drop-wal-outbox)", ErrWALRetired, s.RetiredAt.UTC().Format(time.RFC3339))
	case s.Lost():
		return fmt.Errorf("%w (slot %s): events written and not relayed before it went are lost; see \"Slot loss\" in docs/production/wal-outbox.md, and run `kfn migrate --outbox wal` to create it again", ErrSlotLost, s.Slot)
	}
	return nil
}

// WALSetup is what SetUpWAL did.
type WALSetup struct {
	Slot        string
	Publication string
	// CreatedSlot and CreatedPublication say what it created; neither when
	// both were there.
	CreatedSlot, CreatedPublication bool
	// Recreated is set when the slot had been set up before and was gone:
	// the events written and not relayed before it went are lost (the
	// caller says how to recover them). LostSince is the reader's last
	// confirmation before it went: the loss lies after it.
	Recreated bool
	LostSince time.Time
}

// SetUpWAL sets up the WAL outbox in pool's database: it checks
// wal_level, creates the publication and the logical replication slot
// (pgoutput) if they are missing, and records them in kfn.wal_outbox. It
// needs the REPLICATION attribute (or superuser, or the managed service's
// replication role) to create the slot, and CREATE on the database for
// the publication; a missing right is named in the error. The schema must
// be migrated first. A retired WAL outbox not yet dropped is taken back:
// emits are accepted again.
func SetUpWAL(ctx context.Context, pool *pgxpool.Pool) (WALSetup, error) {
	var out WALSetup
	if err := CheckWALLevel(ctx, pool); err != nil {
		return out, err
	}
	var database, role string
	if err := pool.QueryRow(ctx, `SELECT current_database(), current_user`).Scan(&database, &role); err != nil {
		return out, fmt.Errorf("set up the WAL outbox: %w", err)
	}
	before, err := ReadWALState(ctx, pool)
	if err != nil {
		return out, err
	}
	out.Slot, out.Publication = WALSlotName(database), WALPublication
	if before.SetUp {
		out.Slot = before.Slot
	}
	var pubExists bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)`, out.Publication).Scan(&pubExists); err != nil {
		return out, fmt.Errorf("set up the WAL outbox: %w", err)
	}
	if !pubExists {
		if _, err := pool.Exec(ctx, `CREATE PUBLICATION `+pgx.Identifier{out.Publication}.Sanitize()); err != nil {
			return out, privilegeError(err, role, "create the publication "+out.Publication, "CREATE on database "+database)
		}
		out.CreatedPublication = true
	}
	var lsn *string
	if before.SetUp && before.SlotExists && before.SlotStatus == "lost" {
		// WAL it needed was removed (max_slot_wal_keep_size): it can never
		// be read again. Drop it, so that it is made anew below.
		if _, err := pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, out.Slot); err != nil {
			return out, privilegeError(err, role, "drop the invalidated slot "+out.Slot, "REPLICATION")
		}
		before.SlotExists = false
	}
	var slotExists bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)`, out.Slot).Scan(&slotExists); err != nil {
		return out, fmt.Errorf("set up the WAL outbox: %w", err)
	}
	if !slotExists {
		var created string
		if err := pool.QueryRow(ctx, `SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')`, out.Slot).Scan(&created); err != nil {
			return out, privilegeError(err, role, "create the replication slot "+out.Slot, "REPLICATION")
		}
		lsn = &created
		out.CreatedSlot = true
		if before.SetUp {
			out.Recreated, out.LostSince = true, before.ConfirmedAt
			if out.LostSince.IsZero() {
				out.LostSince = before.LostAt
			}
		}
	}
	if _, err := pool.Exec(ctx, `
INSERT INTO kfn.wal_outbox (slot_name, publication, created_lsn) VALUES ($1, $2, $3::pg_lsn)
ON CONFLICT (id) DO UPDATE SET slot_name = EXCLUDED.slot_name, publication = EXCLUDED.publication,
       created_lsn = coalesce(EXCLUDED.created_lsn, kfn.wal_outbox.created_lsn),
       created_at = CASE WHEN EXCLUDED.created_lsn IS NULL THEN kfn.wal_outbox.created_at ELSE now() END,
       lost_at = CASE WHEN EXCLUDED.created_lsn IS NULL THEN kfn.wal_outbox.lost_at END,
       retired_at = NULL, retired_lsn = NULL`, out.Slot, out.Publication, lsn); err != nil {
		return out, fmt.Errorf("record the WAL outbox's slot: %w", err)
	}
	return out, nil
}

// privilegeError names the right a role lacks when err is Postgres's
// insufficient_privilege.
func privilegeError(err error, role, what, right string) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		hint := ""
		if right == "REPLICATION" {
			hint = fmt.Sprintf(" (ALTER ROLE %s REPLICATION as a superuser; on Amazon RDS and Aurora: GRANT rds_replication TO %s; on Cloud SQL: ALTER USER %s WITH REPLICATION; on Azure: ALTER ROLE %s WITH REPLICATION)",
				pgx.Identifier{role}.Sanitize(), pgx.Identifier{role}.Sanitize(), pgx.Identifier{role}.Sanitize(), pgx.Identifier{role}.Sanitize())
		}
		return fmt.Errorf("%s: role %s lacks %s%s: %w", what, role, right, hint, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}
