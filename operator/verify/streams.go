package verify

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The three ordered streams Postgres gives the walk, each on a connection
// of its own that reads the run's snapshot (SET TRANSACTION SNAPSHOT), so
// that none needs a sort or a join of the whole range: the inbox comes in
// its primary key's order, the dead letters in their unique key's, and
// only the effects query's rows are sorted (by its own columns, so that an
// index on them spares the sort), in memory up to effectsWorkMem.
const (
	// The inbox is keyed by lane (one per partition) and offset: the lanes
	// in partition order, and each lane's rows in its key's order, which a
	// nested loop keeps (an ORDER BY over both would sort a whole
	// partition). The stream checks that order as it reads (inboxOrdered).
	inboxSQL = `SELECT l.partition, i."offset", i.epoch, i.outcome = 'dead_lettered'
  FROM (SELECT id, partition FROM kfn.lanes WHERE consumer = $1 AND topic = $2 ORDER BY partition) l
 CROSS JOIN LATERAL (SELECT "offset", epoch, outcome FROM kfn.inbox WHERE lane = l.id ORDER BY "offset") i`
	deadLettersSQL = `SELECT DISTINCT partition, "offset" FROM kfn.dead_letters
 WHERE consumer = $1 AND topic = $2 ORDER BY partition, "offset"`
	effectsSQL = `SELECT source_partition::int, source_offset::bigint FROM (%s) AS effects(source_topic, source_partition, source_offset)
 WHERE source_topic = $1 ORDER BY source_partition, source_offset`

	// A ranged run's three streams read its scope only: its partitions
	// and the [from, to) offsets of each, as three arrays (scope.args).
	// The inbox then reads an index range per lane, the dead letters one
	// per partition, and the effects the rows of each partition's span
	// (Postgres pulls a plain query up into the join, so that an index on
	// its columns reads the span only).
	inboxInScopeSQL = `SELECT l.partition, i."offset", i.epoch, i.outcome = 'dead_lettered'
  FROM (SELECT lanes.id, lanes.partition, r.lo, r.hi FROM unnest($3::int[], $4::bigint[], $5::bigint[]) AS r(p, lo, hi)
          JOIN kfn.lanes ON lanes.consumer = $1 AND lanes.topic = $2 AND lanes.partition = r.p ORDER BY lanes.partition) l
 CROSS JOIN LATERAL (SELECT "offset", epoch, outcome FROM kfn.inbox WHERE lane = l.id AND "offset" >= l.lo AND "offset" < l.hi ORDER BY "offset") i`
	deadLettersInScopeSQL = `SELECT DISTINCT d.partition, d."offset" FROM unnest($3::int[], $4::bigint[], $5::bigint[]) AS r(p, lo, hi)
  JOIN kfn.dead_letters d ON d.consumer = $1 AND d.topic = $2 AND d.partition = r.p AND d."offset" >= r.lo AND d."offset" < r.hi
 ORDER BY d.partition, d."offset"`
	effectsInScopeSQL = `SELECT r.p, e.source_offset::bigint FROM unnest($2::int[], $3::bigint[], $4::bigint[]) AS r(p, lo, hi)
 CROSS JOIN LATERAL (SELECT source_offset FROM (%s) AS effects(source_topic, source_partition, source_offset)
                      WHERE source_topic = $1 AND source_partition = r.p AND source_offset >= r.lo AND source_offset < r.hi) e
 ORDER BY r.p, e.source_offset`
	effectsWorkMem = `SET LOCAL work_mem = '64MB'`

	// A NATS-triggered function's streams are keyed by event id, in byte
	// order (COLLATE "C", Go's string order): its event inbox (which holds
	// its dead-lettered events too) and the (event_id) effects.
	eventInboxSQL = `SELECT event_id COLLATE "C" AS id, epoch, outcome = 'dead_lettered', stream_seq,
       processed_at >= coalesce((SELECT changed_at FROM kfn.subject_lanes WHERE consumer = $1 AND subject = $2), '-infinity')
  FROM kfn.event_inbox WHERE consumer = $1 ORDER BY id`
	eventEffectsSQL = `SELECT event_id::text COLLATE "C" AS id FROM (%s) AS effects(event_id) ORDER BY id`
)

// position is where a stream's row is: a record's partition and offset,
// or (for a NATS-triggered function) an event id.
type position struct {
	p  int32
	o  int64
	id string
}

// String names the position in an example: a record's partition@offset,
// or an event's id, stream sequence (o) and lane (p).
func (a position) String() string {
	if a.id != "" {
		return fmt.Sprintf("event %s (stream seq %d, lane %d)", a.id, a.o, a.p)
	}
	return fmt.Sprintf("%d@%d", a.p, a.o)
}

func (a position) less(b position) bool {
	return before(a.p, a.o, b.p, b.o) || a.p == b.p && a.o == b.o && a.id < b.id
}

// stream is one ordered query: its current row's position and values.
type stream struct {
	name string
	tx   pgx.Tx
	conn *pgxpool.Conn
	rows pgx.Rows
	scan []any // after the position
	byID bool  // the position is an event id (else a partition and offset)
	// increasing: each row's position must be after the one before (a
	// query whose order the SQL does not state; see inboxSQL).
	increasing bool
	pos        position
	ok         bool
	err        error
}

// query is one stream's query: its settings (SET LOCAL statements), its
// SQL and arguments, and where its columns after p and o go.
type query struct {
	settings []string
	sql      string
	args     []any
	scan     []any
	byID     bool
	// increasing: the rows come in strictly increasing positions (checked
	// as they are read).
	increasing bool
}

// openStream begins a read-only transaction on a connection of its own
// that reads snapshot, and runs q there.
func openStream(ctx context.Context, pool *pgxpool.Pool, snapshot, name string, q query) (*stream, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	s := &stream{name: name, conn: conn, scan: q.scan, byID: q.byID, increasing: q.increasing}
	if s.tx, err = conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}); err == nil {
		_, err = s.tx.Exec(ctx, `SET TRANSACTION SNAPSHOT '`+snapshot+`'`)
	}
	for _, set := range append([]string{`SET LOCAL jit = off`}, q.settings...) {
		if err == nil {
			_, err = s.tx.Exec(ctx, set)
		}
	}
	if err == nil {
		s.rows, err = s.tx.Query(ctx, q.sql, q.args...)
	}
	if err != nil {
		s.close(ctx)
		return nil, err
	}
	s.next()
	return s, nil
}

func (s *stream) next() {
	if s.err != nil || !s.rows.Next() {
		s.ok = false
		if s.err == nil {
			s.err = s.rows.Err()
		}
		return
	}
	before, first := s.pos, !s.ok
	at := []any{&s.pos.p, &s.pos.o}
	if s.byID {
		at = []any{&s.pos.id}
	}
	if err := s.rows.Scan(append(at, s.scan...)...); err != nil {
		s.ok, s.err = false, fmt.Errorf("read %s: %w", s.name, err)
		return
	}
	if s.increasing && !first && !before.less(s.pos) {
		s.ok, s.err = false, fmt.Errorf("read %s: its rows came out of order (%s after %s)", s.name, s.pos, before)
		return
	}
	s.ok = true
}

func (s *stream) close(ctx context.Context) {
	if s.rows != nil {
		s.rows.Close()
	}
	if s.tx != nil {
		s.tx.Rollback(ctx) //nolint:errcheck // read-only
	}
	s.conn.Release()
}

// at reports whether the stream's current row is at pos.
func (s *stream) at(pos position) bool { return s.ok && s.pos == pos }

// records merges the streams into one pgRow per position, in order: for a
// Kafka-triggered function the inbox, the dead letters and the effects by
// record; for a NATS-triggered one the event inbox and the effects by
// event id (dead is nil).
type records struct {
	inbox, dead, effects *stream
	epoch, seq           int64
	ibDead, sameLanes    bool
}

func openRecords(ctx context.Context, pool *pgxpool.Pool, snapshot string, spec Spec, eff *effects, sc *scope) (*records, error) {
	r := &records{}
	var err error
	args, inboxQ, deadQ := []any{spec.Function, spec.Topic}, inboxSQL, deadLettersSQL
	if sc != nil {
		args, inboxQ, deadQ = append(args, sc.args()...), inboxInScopeSQL, deadLettersInScopeSQL
	}
	if r.inbox, err = openStream(ctx, pool, snapshot, "the inbox", query{sql: inboxQ, args: args, scan: []any{&r.epoch, &r.ibDead}, increasing: true}); err != nil {
		return nil, fmt.Errorf("read the inbox of %s: %w", spec.Function, err)
	}
	if r.dead, err = openStream(ctx, pool, snapshot, "the dead letters", query{sql: deadQ, args: args}); err != nil {
		r.close(ctx)
		return nil, fmt.Errorf("read the dead letters of %s: %w", spec.Function, err)
	}
	if eff.shape == shapePerRecord {
		q := query{settings: []string{effectsWorkMem}, sql: fmt.Sprintf(effectsSQL, eff.sql), args: []any{spec.Topic}}
		if sc != nil {
			q.sql, q.args = fmt.Sprintf(effectsInScopeSQL, eff.sql), append(q.args, sc.args()...)
		}
		if r.effects, err = openStream(ctx, pool, snapshot, "the effects", q); err != nil {
			r.close(ctx)
			return nil, specError("effects-sql", "the query's rows do not read as (source_topic text, source_partition int, source_offset bigint): %v", err)
		}
	}
	return r, nil
}

// openEventRecords opens the streams of a NATS-triggered function.
func openEventRecords(ctx context.Context, pool *pgxpool.Pool, snapshot string, spec Spec, eff *effects) (*records, error) {
	r := &records{}
	var err error
	if r.inbox, err = openStream(ctx, pool, snapshot, "the event inbox", query{settings: []string{effectsWorkMem}, sql: eventInboxSQL,
		args: []any{spec.Function, spec.Topic}, scan: []any{&r.epoch, &r.ibDead, &r.seq, &r.sameLanes}, byID: true}); err != nil {
		return nil, fmt.Errorf("read the event inbox of %s: %w", spec.Function, err)
	}
	if eff.shape == shapePerRecord {
		if r.effects, err = openStream(ctx, pool, snapshot, "the effects",
			query{settings: []string{effectsWorkMem}, sql: fmt.Sprintf(eventEffectsSQL, eff.sql), byID: true}); err != nil {
			r.close(ctx)
			return nil, specError("effects-sql", "the query's rows do not read as (event_id text): %v", err)
		}
	}
	return r, nil
}

func (r *records) streams() []*stream {
	var out []*stream
	for _, s := range []*stream{r.inbox, r.dead, r.effects} {
		if s != nil {
			out = append(out, s)
		}
	}
	return out
}

func (r *records) close(ctx context.Context) {
	for _, s := range r.streams() {
		s.close(ctx)
	}
}

// next returns the next position any stream has a row for, merged; false
// at the end of all of them or on an error (err).
func (r *records) next(row *pgRow) bool {
	first := (*stream)(nil)
	for _, s := range r.streams() {
		if s.ok && (first == nil || s.pos.less(first.pos)) {
			first = s
		}
	}
	if first == nil {
		return false
	}
	*row = pgRow{position: first.pos}
	if r.inbox.at(row.position) {
		epoch, dead := r.epoch, r.ibDead
		row.epoch, row.ibDead, row.seq, row.sameLanes = &epoch, &dead, r.seq, r.sameLanes
		r.inbox.next()
	}
	if r.dead != nil && r.dead.at(row.position) {
		row.dead = true
		r.dead.next()
	}
	for r.effects != nil && r.effects.at(row.position) {
		row.effects++
		r.effects.next()
	}
	return true
}

func (r *records) err() error {
	var errs []error
	for _, s := range r.streams() {
		errs = append(errs, s.err)
	}
	return errors.Join(errs...)
}
