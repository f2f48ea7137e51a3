package verify

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/outbox"
)

// shape is the shape of the user's effects query.
type shape int

const (
	shapeNone      shape = iota // no query: the inbox is the evidence
	shapePerRecord              // (source_topic, source_partition, source_offset)
	shapeKeyed                  // (key, count)
	shapeTotal                  // (count)
)

// effects is the user's effects query and, for the counting shapes, what
// it returned.
type effects struct {
	sql   string
	shape shape
	// events: the function is NATS-triggered, its per-record shape is
	// (event_id) and its keys are event keys.
	events bool
	// keyIsBytes: the keyed shape's key column is bytea (else it is read
	// as text, compared with the Kafka key's bytes).
	keyIsBytes bool
	// perKey holds, for the keyed shape, each key's count minus the applied
	// records of that key seen so far; total is the total shape's count.
	perKey map[string]int64
	total  int64
	sum    int64 // the effects counted (rows or counts)
}

func (e *effects) describe() string {
	switch e.shape {
	case shapePerRecord:
		if e.events {
			return "one row per applied event (--effects-sql)"
		}
		return "one row per applied record (--effects-sql)"
	case shapeKeyed:
		return "a count per record key (--effects-sql), compared with the applied records of each key"
	case shapeTotal:
		return "one total count (--effects-sql), compared with the applied records"
	}
	return "no --effects-sql: an inbox row is the evidence of an applied record (inbox rows are purged after --inbox-retention)"
}

// probeEffects runs the query for its columns only and tells its shape;
// events: the function is NATS-triggered.
func probeEffects(ctx context.Context, tx pgx.Tx, sql string, events bool) (*effects, error) {
	sql = strings.TrimRight(strings.TrimSpace(sql), "; \t\r\n")
	if sql == "" {
		return &effects{shape: shapeNone, events: events}, nil
	}
	rows, err := tx.Query(ctx, `SELECT * FROM (`+sql+`) AS effects LIMIT 0`)
	if err != nil {
		return nil, specError("effects-sql", "the query fails: %v", err)
	}
	fields := rows.FieldDescriptions()
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, specError("effects-sql", "the query fails: %v", err)
	}
	e := &effects{sql: sql, events: events}
	const byteaOID, textOID, varcharOID = 17, 25, 1043
	switch n := len(fields); {
	case n == 3 && !events:
		e.shape = shapePerRecord
	case n == 2:
		e.shape, e.keyIsBytes = shapeKeyed, fields[0].DataTypeOID == byteaOID
	case n == 1 && events && (fields[0].DataTypeOID == textOID || fields[0].DataTypeOID == varcharOID):
		e.shape = shapePerRecord
	case n == 1:
		e.shape = shapeTotal
	case events:
		return nil, specError("effects-sql", "the query returns %d columns; for a NATS-triggered function return (event_id) per applied event, (key, count) per event key, or (count)", n)
	default:
		return nil, specError("effects-sql", "the query returns %d columns; return (source_topic, source_partition, source_offset) per applied record, (key, count) per record key, or (count)", n)
	}
	return e, nil
}

// readCounts reads the counting shapes' counts.
func (e *effects) readCounts(ctx context.Context, tx pgx.Tx) error {
	if e.shape == shapeTotal {
		if err := tx.QueryRow(ctx, `SELECT coalesce(sum(n), 0)::bigint FROM (`+e.sql+`) AS effects(n)`).Scan(&e.total); err != nil {
			return specError("effects-sql", "read the count: %v", err)
		}
		e.sum = e.total
		return nil
	}
	key := "k::text"
	if e.keyIsBytes {
		key = "k"
	}
	rows, err := tx.Query(ctx, `SELECT `+key+`, n::bigint FROM (`+e.sql+`) AS effects(k, n)`)
	if err != nil {
		return specError("effects-sql", "read the counts per key: %v", err)
	}
	e.perKey = map[string]int64{}
	var k []byte
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&k, &n}, func() error {
		e.perKey[string(k)] += n
		e.sum += n
		return nil
	})
	if err != nil {
		return specError("effects-sql", "read the counts per key: %v", err)
	}
	return nil
}

// history is what the audit log says about the partitions: the epochs
// that claimed each (or took its lease for an operator's change) and where
// each claim found the cursor, the ranges a re-execution left handled
// under their old epochs, and the records a dead letter retry applied.
type history struct {
	epochs   map[int32]map[int64]bool
	minEpoch map[int32]int64
	claims   map[int32][]claimAt  // sorted by position
	kept     map[int32][][2]int64 // [to, previous high water) of each re-execution
	redone   map[int32][][2]int64 // [from, to) of each re-execution
	retried  map[int32]map[int64]bool
}

// claimAt is a claim of a partition: its epoch, and the position from
// which the partition was the claimer's (the larger of the cursor's
// next_offset and high_water when it claimed).
type claimAt struct {
	epoch, position int64
}

func (h *history) wasRetried(p int32, o int64) bool { return h.retried[p][o] }

// reexecutions counts the re-executions (kfn replay --reexecute, an
// audited choice to apply records again) that applied o again.
func (h *history) reexecutions(p int32, o int64) int64 {
	var n int64
	for _, r := range h.redone[p] {
		if o >= r[0] && o < r[1] {
			n++
		}
	}
	return n
}

// handledBefore is the highest high-water mark a re-execution lowered on
// p: the records below it were handled before, whatever the cursor says
// while the re-execution runs.
func (h *history) handledBefore(p int32) int64 {
	var high int64
	for _, r := range h.kept[p] {
		high = max(high, r[1])
	}
	return high
}

// keptByReexecution reports whether a re-execution left o handled under
// the epoch that first committed it, below a later claim's position.
func (h *history) keptByReexecution(p int32, o int64) bool {
	for _, r := range h.kept[p] {
		if o >= r[0] && o < r[1] {
			return true
		}
	}
	return false
}

func readHistory(ctx context.Context, tx pgx.Tx, spec Spec) (*history, error) {
	h := &history{epochs: map[int32]map[int64]bool{}, minEpoch: map[int32]int64{}, claims: map[int32][]claimAt{},
		kept: map[int32][][2]int64{}, redone: map[int32][][2]int64{}, retried: map[int32]map[int64]bool{}}
	rows, err := tx.Query(ctx, `
SELECT partition, action, (details->>'epoch')::bigint, (details->>'from')::bigint, (details->>'to')::bigint, (details->>'offset')::bigint,
       greatest((details->>'next_offset')::bigint, (details->>'high_water')::bigint, (details->>'key_lanes_reached')::bigint),
       (details->>'previous_high_water')::bigint
  FROM kfn.audit_log
 WHERE consumer = $1 AND topic = $2 AND (details ? 'epoch' OR action IN ($3, 'reexecute'))`, spec.Function, spec.Topic, inbox.ActionRetryApplied)
	if err != nil {
		return nil, fmt.Errorf("read the audit log of %s: %w", spec.Function, err)
	}
	var p int32
	var action string
	var epoch, from, to, offset, position, previousHigh *int64
	_, err = pgx.ForEachRow(rows, []any{&p, &action, &epoch, &from, &to, &offset, &position, &previousHigh}, func() error {
		if epoch != nil {
			if h.epochs[p] == nil {
				h.epochs[p] = map[int64]bool{}
			}
			h.epochs[p][*epoch] = true
			if m, ok := h.minEpoch[p]; !ok || *epoch < m {
				h.minEpoch[p] = *epoch
			}
		}
		switch {
		case action == inbox.ActionClaim && epoch != nil && position != nil:
			h.claims[p] = append(h.claims[p], claimAt{epoch: *epoch, position: *position})
		case action == "reexecute" && from != nil && to != nil && previousHigh != nil:
			h.kept[p] = append(h.kept[p], [2]int64{*to, *previousHigh})
			h.redone[p] = append(h.redone[p], [2]int64{*from, *to})
		case action == inbox.ActionRetryApplied && offset != nil:
			if h.retried[p] == nil {
				h.retried[p] = map[int64]bool{}
			}
			h.retried[p][*offset] = true
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the audit log of %s: %w", spec.Function, err)
	}
	for _, cs := range h.claims {
		slices.SortFunc(cs, func(a, b claimAt) int { return cmp.Compare(a.position, b.position) })
	}
	return h, nil
}

// unpublishedSQL selects the function's outbox rows older than $3
// microseconds, of the records in the scope ($4, $5, $6 as in inboxSQL).
const unpublishedSQL = `FROM kfn.outbox o
 WHERE source = $1 AND source_topic = $2 AND created_at < now() - $3 * interval '1 microsecond'
   AND ($4::int[] IS NULL OR EXISTS (SELECT FROM unnest($4::int[], $5::bigint[], $6::bigint[]) AS r(p, lo, hi)
                                      WHERE r.p = o.source_partition AND o.source_offset >= r.lo AND o.source_offset < r.hi))`

// checkOutbox counts the function's outbox rows of the records in sc
// older than spec.UnpublishedAfter at the snapshot into rep: the relay
// publishes a row and deletes it, so an old row is an event that has not
// reached the stream. With the WAL outbox (docs/production/wal-outbox.md)
// the events are in the slot, not in rows: checkWALOutbox counts those,
// over the whole database, so not for a range (a note says so).
func checkOutbox(ctx context.Context, tx pgx.Tx, spec Spec, sc *scope, rep *Report) error {
	v := &rep.Violations.Unpublished
	if sc == nil {
		if err := checkWALOutbox(ctx, tx, spec, v); err != nil {
			return err
		}
	} else if w, err := outbox.ReadWALState(ctx, tx); err != nil {
		return err
	} else if w.SetUp {
		rep.Cut.Notes = append(rep.Cut.Notes, "the WAL outbox slot's unrelayed events are counted for the whole database, not per record: not checked over a range (run kfn verify without one, or see kfn status)")
	}
	args := append([]any{spec.Function, spec.Topic, spec.UnpublishedAfter.Microseconds()}, sc.args()...)
	var n int64
	if err := tx.QueryRow(ctx, `SELECT count(*) `+unpublishedSQL, args...).Scan(&n); err != nil {
		return fmt.Errorf("read the outbox: %w", err)
	}
	if n == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, `SELECT event_id, subject, source_partition, source_offset, extract(epoch FROM now() - created_at)::float8 `+unpublishedSQL+` ORDER BY id LIMIT $7`,
		append(args, v.max)...)
	if err != nil {
		return fmt.Errorf("read the outbox: %w", err)
	}
	var id, subject string
	var p int32
	var o int64
	var age float64
	_, err = pgx.ForEachRow(rows, []any{&id, &subject, &p, &o, &age}, func() error {
		v.Examples = append(v.Examples, fmt.Sprintf("event %s on %s for %d@%d in the outbox for %s (older than %s)",
			id, subject, p, o, time.Duration(age*float64(time.Second)).Round(time.Millisecond), spec.UnpublishedAfter))
		return nil
	})
	v.Count += n
	if err != nil {
		return fmt.Errorf("read the outbox: %w", err)
	}
	return nil
}

// checkWALOutbox counts the events the WAL outbox slot still holds
// unrelayed, as its reader last reported them (outbox.ReadWALState, which
// kfn status and /metrics show), when the oldest was emitted before
// spec.UnpublishedAfter; and a lost slot, whose unrelayed events are gone.
// The reader reports for the whole database, every function's events.
func checkWALOutbox(ctx context.Context, tx pgx.Tx, spec Spec, v *Violation) error {
	w, err := outbox.ReadWALState(ctx, tx)
	if err != nil || !w.SetUp {
		return err
	}
	var now time.Time
	if err := tx.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		return fmt.Errorf("read the database's clock: %w", err)
	}
	switch {
	case w.Lost():
		v.add("the WAL outbox slot %s is lost: the events written and not relayed before it went are not in the stream (docs/production/wal-outbox.md, \"Slot loss\")", w.Slot)
	case w.Pending > 0 && !w.OldestPending.IsZero() && now.Sub(w.OldestPending) > spec.UnpublishedAfter:
		v.addN(w.Pending, "%d events in the WAL outbox slot %s read and not acked by the stream, the oldest emitted %s ago (older than %s), as its reader %s reported %s ago; the slot holds %d bytes of WAL (every function's events in this database)",
			w.Pending, w.Slot, now.Sub(w.OldestPending).Round(time.Millisecond), spec.UnpublishedAfter, w.Reader, now.Sub(w.ReportedAt).Round(time.Millisecond), w.LagBytes)
	}
	return nil
}
