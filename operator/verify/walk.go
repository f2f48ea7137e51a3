package verify

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/kfn-dev/kfn/internal/kafkasource"
)

// pgRow is what Postgres holds for one offset, or one event id (see
// records).
type pgRow struct {
	position
	epoch *int64 // nil: no inbox row
	// seq is an event inbox row's stream sequence; sameLanes: the row was
	// committed under the current lane count.
	seq       int64
	sameLanes bool
	ibDead    *bool
	dead      bool // a dead letter
	effects   int64
}

func (r *pgRow) deadLettered() bool { return r != nil && (r.dead || r.ibDead != nil && *r.ibDead) }

// what says what Postgres holds for the record, for an example.
func (r *pgRow) what() string {
	var parts []string
	if r.effects > 0 {
		parts = append(parts, fmt.Sprintf("%d effects", r.effects))
	}
	if r.epoch != nil {
		parts = append(parts, fmt.Sprintf("an inbox row (epoch %d)", *r.epoch))
	}
	if r.dead {
		parts = append(parts, "a dead letter")
	}
	return strings.Join(parts, ", ")
}

// keyCount is a key's effects count minus the applied records of the key
// seen so far, how many more effects re-executions allow (they may not
// have applied their records again yet), and whether Kafka had a record of
// the key.
type keyCount struct {
	left  int64
	slack int64
	seen  bool
}

// walk merges, one partition at a time, the records Kafka holds with what
// Postgres holds for them (records) and the function's events, all in
// offset order.
type walk struct {
	spec   Spec
	rep    *Report
	klog   *kafkasource.Log
	eff    *effects
	hist   *history
	events *streamEvents
	scope  *scope // nil: the whole topic

	pg     *records
	row    pgRow
	rowOK  bool
	rowErr error
	ei     int // the next event of events.list

	keys           map[string]keyCount // the keyed shape's
	applied, slack int64               // the total shape's

	started, lastProgress time.Time
	toCheck               int64
}

// partState is the partition being walked. Its high is Kafka's high
// watermark, or the range's end below it.
type partState struct {
	kafkaPartition
	from    int64 // Kafka's first offset, or the range's start above it
	bound   int64 // the cursor (0 without one)
	checkTo int64 // records in [from, checkTo) are checked
	fence   *fence
	// keyLanes: the partition runs as key-lanes, whose rows and events
	// above the cursor (of records Kafka holds) are pending, not compared.
	keyLanes bool
}

// pendingAbove reports whether a row or event of offset o is one a key-lane
// committed above the cursor: pending, like the records from the cursor on.
func (s *partState) pendingAbove(o int64) bool {
	return s != nil && s.keyLanes && o >= s.checkTo && o < s.high
}

func (w *walk) run(ctx context.Context, pool *pgxpool.Pool, snapshot string, parts []kafkaPartition) error {
	pg, err := openRecords(ctx, pool, snapshot, w.spec, w.eff, w.scope)
	if err != nil {
		return err
	}
	w.pg = pg
	defer pg.close(ctx)
	w.initKeys()
	var states []*partState
	for _, p := range parts {
		sp := span{from: p.first, to: math.MaxInt64}
		if w.scope != nil {
			asked, ok := w.scope.spans[p.id]
			if !ok {
				continue
			}
			sp.from = max(sp.from, asked.from)
			sp.to = asked.to
		}
		s := &partState{kafkaPartition: p, from: sp.from}
		pc := PartitionCut{Partition: p.id, KafkaFirst: p.first, KafkaHigh: p.high, Cursor: -1, HighWater: -1, CheckedFrom: s.from}
		epoch := int64(-1)
		if p.cursor != nil {
			s.bound, epoch = max(p.cursor.bound(), w.hist.handledBefore(p.id)), p.cursor.epoch
			s.keyLanes = p.cursor.keyLanes
			pc.Cursor, pc.HighWater = p.cursor.next, p.cursor.high
			if s.bound > p.high {
				w.rep.Cut.Notes = append(w.rep.Cut.Notes, fmt.Sprintf("partition %d: the cursor %d is past Kafka's high watermark %d (was the topic recreated?)", p.id, s.bound, p.high))
			}
		}
		s.high = min(p.high, max(s.from, sp.to)) // the range's end, within Kafka's
		s.checkTo = max(s.from, min(s.bound, s.high))
		s.fence = newFence(p.id, w.hist, epoch)
		pc.CheckedBelow = s.checkTo
		pc.Pending = max(0, s.high-max(s.bound, s.from))
		w.rep.Cut.Partitions = append(w.rep.Cut.Partitions, pc)
		w.toCheck += s.checkTo - s.from
		states = append(states, s)
	}
	w.nextRow()
	for _, s := range states {
		w.orphansBefore(ctx, nil, s.id, math.MinInt64)
		// A partition run as key-lanes is read up to Kafka's high
		// watermark: the records above the cursor that a key-lane
		// committed are checked like those below it (their effects count
		// for their keys), and the others are pending.
		scanTo := s.checkTo
		if s.keyLanes {
			scanTo = max(s.checkTo, s.high)
		}
		err := w.klog.Scan(ctx, w.spec.Topic, s.id, s.from, scanTo, func(o int64, key []byte) error {
			if o >= s.checkTo {
				w.orphansBefore(ctx, s, s.id, o)
				if !w.rowOK || w.row.p != s.id || w.row.o != o {
					return w.rowErr // above the cursor and not handled yet: pending
				}
			}
			w.record(ctx, s, o, key)
			return w.rowErr
		})
		if err != nil {
			return err
		}
		w.orphansBefore(ctx, s, s.id, math.MaxInt64)
	}
	w.orphansBefore(ctx, nil, math.MaxInt32, math.MaxInt64)
	if w.rowErr != nil {
		return fmt.Errorf("read the inbox and dead letters of %s: %w", w.spec.Function, w.rowErr)
	}
	w.finishCounts()
	return nil
}

// initKeys starts the keyed shape's counts from the query's.
func (w *walk) initKeys() {
	if w.eff.shape == shapeKeyed {
		w.keys = make(map[string]keyCount, len(w.eff.perKey))
		for k, n := range w.eff.perKey {
			w.keys[k] = keyCount{left: n}
		}
	}
}

func (w *walk) nextRow() {
	w.rowOK = w.pg.next(&w.row)
	if !w.rowOK {
		w.rowErr = w.pg.err()
		return
	}
	w.rep.Checked.Effects += w.row.effects
}

// before reports whether (p, o) comes before (p2, o2).
func before(p int32, o int64, p2 int32, o2 int64) bool { return p < p2 || p == p2 && o < o2 }

// orphansBefore reports the rows and events before (p, o) that no record
// Kafka holds below the cursor matched. s is their partition, or nil when
// it is none of the topic's partitions with a record or a cursor.
func (w *walk) orphansBefore(ctx context.Context, s *partState, p int32, o int64) {
	vs := &w.rep.Violations
	for w.rowOK && before(w.row.p, w.row.o, p, o) {
		r := w.row
		switch {
		case s == nil:
			vs.Unexpected.add("%d@%d has %s, but the topic has no partition %d with a cursor", r.p, r.o, r.what(), r.p)
		case r.o < s.first, s.pendingAbove(r.o):
			// below what Kafka still holds: nothing to compare with; or
			// committed by a key-lane above the cursor: pending
		case r.o >= s.checkTo:
			vs.Unexpected.add("%d@%d has %s, at or above the cursor %d", r.p, r.o, r.what(), s.bound)
		default:
			vs.Unexpected.add("%d@%d has %s, but Kafka holds no record there", r.p, r.o, r.what())
		}
		w.nextRow()
	}
	for w.events != nil && w.ei < len(w.events.list) {
		e := w.events.list[w.ei]
		if !before(e.p, e.o, p, o) {
			break
		}
		w.ei++
		if s != nil && e.o < s.first || s.pendingAbove(e.o) {
			continue
		}
		if vs.Unexpected.room() {
			vs.Unexpected.add("event %s for %d@%d, which has no record below the cursor", w.events.text(ctx, e), e.p, e.o)
		} else {
			vs.Unexpected.Count++
		}
	}
}

// record checks one record Kafka holds below the cursor.
func (w *walk) record(ctx context.Context, s *partState, o int64, key []byte) {
	w.orphansBefore(ctx, s, s.id, o)
	var r *pgRow
	if w.rowOK && w.row.p == s.id && w.row.o == o {
		row := w.row
		r = &row
		w.nextRow()
	}
	var evs []event
	if w.events != nil {
		start := w.ei
		for w.ei < len(w.events.list) && w.events.list[w.ei].p == s.id && w.events.list[w.ei].o == o {
			w.ei++
		}
		evs = w.events.list[start:w.ei]
	}
	w.rep.Checked.Records++
	// A re-execution applied the record again, on purpose: one more
	// effect each is expected (a dead letter then applied is too).
	redone := w.hist.reexecutions(s.id, o)
	where := position{p: s.id, o: o}
	applied := w.judge(r, key, redone, where, s.bound)
	if r != nil && r.epoch != nil {
		s.fence.check(o, *r.epoch, &w.rep.Violations.FencedButCommitted)
	}
	w.checkEvents(ctx, where, r, applied, redone, evs)
	w.progress(s, o)
}

// judge checks what Postgres holds for one record or event below the
// cursor bound, at where, against the effects shape, and reports whether
// it was applied.
func (w *walk) judge(r *pgRow, key []byte, redone int64, where position, bound int64) bool {
	vs := &w.rep.Violations
	dead := r.deadLettered()
	var applied bool
	switch w.eff.shape {
	case shapePerRecord:
		var n int64
		if r != nil {
			n = r.effects
		}
		switch allowed := 1 + redone; {
		case dead && n > 0 && redone == 0:
			vs.Duplicated.addN(n, "%s was dead-lettered and has %d effects", where, n)
		case n == 0 && !dead:
			vs.Lost.add("%s has no effect and no dead letter (cursor %d)", where, bound)
		case n > allowed:
			vs.Duplicated.addN(n-allowed, "%s has %d effects (re-executed %d times)", where, n, redone)
		}
		applied = !dead && n > 0
	case shapeNone:
		applied = r != nil && r.epoch != nil && !dead
		if !applied && !dead && redone == 0 { // a re-execution deletes the inbox rows it applies again
			vs.Lost.add("%s has no inbox row and no dead letter (cursor %d)", where, bound)
		}
	case shapeKeyed:
		// A record a re-execution dead-lettered keeps the effects it had.
		applied = !dead
		if applied || redone > 0 {
			c := w.keys[string(key)]
			if applied {
				c.left--
			}
			c.slack += redone
			c.seen = true
			w.keys[string(key)] = c
		}
	case shapeTotal:
		applied = !dead
		if applied {
			w.applied++
		}
		w.slack += redone
	}
	return applied
}

// checkEvents checks the events of one record (or input event) at where,
// sorted by id hash, from what Postgres holds for it (r), whether judge
// found it applied, and how often re-executions applied it again.
func (w *walk) checkEvents(ctx context.Context, where position, r *pgRow, applied bool, redone int64, evs []event) {
	if len(evs) == 0 {
		return
	}
	vs := &w.rep.Violations
	// An event is expected of a record the function handled: its effect,
	// or its inbox row when the effect is lost.
	dead := r.deadLettered()
	if handled := applied || redone > 0 || !dead && r != nil && r.epoch != nil; !handled {
		why := "not applied"
		if dead {
			why = "dead-lettered"
		}
		for _, e := range evs {
			if vs.Unexpected.room() {
				vs.Unexpected.add("event %s for %s, which was %s", w.events.text(ctx, e), where, why)
			} else {
				vs.Unexpected.Count++
			}
		}
		return
	}
	derived := false
	for _, e := range evs {
		derived = derived || e.idx >= 0
	}
	for i, e := range evs {
		var v *Violation
		var format string
		switch {
		case e.again && redone == 0: // a re-execution with --keep-event-ids publishes them again
			v, format = &vs.Duplicated, "event %s for %s is in the stream again (first at seq "+fmt.Sprint(evs[i-1].seq)+")"
		case e.idx < 0 && derived:
			v, format = &vs.Duplicated, "event %s is a second event for %s, under an id kfn did not derive for it"
		case e.idx < 0:
			v, format = &vs.Unexpected, "event %s claims to be for %s, but kfn did not derive its id for that record"
		default:
			continue
		}
		if v.room() {
			v.add(format, w.events.text(ctx, e), where)
		} else {
			v.Count++
		}
	}
}

// finishCounts compares the counting shapes' counts with the applied
// records.
func (w *walk) finishCounts() {
	if w.eff.shape == shapeKeyed || w.eff.shape == shapeTotal {
		w.rep.Checked.Effects = w.eff.sum
	}
	vs := &w.rep.Violations
	switch w.eff.shape {
	case shapeKeyed:
		for k, c := range w.keys {
			switch {
			case !c.seen && c.left > 0:
				vs.Unexpected.addN(c.left, "key %q has %d effects but no record in Kafka", k, c.left)
			case !c.seen:
			case c.left < 0:
				vs.Lost.addN(-c.left, "key %q: %d applied records more than effects", k, -c.left)
			case c.left > c.slack:
				vs.Duplicated.addN(c.left-c.slack, "key %q: %d effects more than applied records (and re-executions)", k, c.left-c.slack)
			}
		}
	case shapeTotal:
		switch d := w.eff.total - w.applied; {
		case d < 0:
			vs.Lost.addN(-d, "%d applied records, %d effects", w.applied, w.eff.total)
		case d > w.slack:
			vs.Duplicated.addN(d-w.slack, "%d applied records (and %d re-executed), %d effects", w.applied, w.slack, w.eff.total)
		}
	}
}

func (w *walk) progress(s *partState, o int64) {
	if w.spec.Progress == nil || w.rep.Checked.Records%65536 != 0 || time.Since(w.lastProgress) < 2*time.Second {
		return
	}
	w.lastProgress = time.Now()
	n := w.rep.Checked.Records
	fmt.Fprintf(w.spec.Progress, "kfn verify: %d of %d records checked (%d%%), partition %d at offset %d, %.0f records/s\n",
		n, w.toCheck, 100*n/max(1, w.toCheck), s.id, o, float64(n)/time.Since(w.started).Seconds())
}

// fence checks the epochs of a partition's inbox rows (or a lane's event
// inbox rows, by stream sequence), in any order: a row's epoch must have
// claimed the partition, and no claim by a newer epoch may have found the
// cursor at or below the row (from that position on the partition was the
// newer epoch's, so the older one committed the row after it had been
// fenced).
type fence struct {
	p        int32
	hist     *history
	known    map[int64]bool
	minKnown int64
	claims   []claimAt // by position
	newest   []claimAt // newest[i]: the claim of the newest epoch in claims[:i+1]
}

func newFence(p int32, hist *history, cursorEpoch int64) *fence {
	f := &fence{p: p, hist: hist, known: hist.epochs[p], minKnown: hist.minEpoch[p], claims: hist.claims[p]}
	if len(f.known) > 0 && cursorEpoch >= 0 {
		f.known[cursorEpoch] = true
	}
	f.newest = make([]claimAt, len(f.claims))
	for i, c := range f.claims {
		if i > 0 && f.newest[i-1].epoch >= c.epoch {
			c = f.newest[i-1]
		}
		f.newest[i] = c
	}
	return f
}

func (f *fence) check(o, epoch int64, v *Violation) {
	var newest claimAt // of the claims at or below o
	if n, _ := slices.BinarySearchFunc(f.claims, o+1, func(c claimAt, t int64) int { return cmp.Compare(c.position, t) }); n > 0 {
		newest = f.newest[n-1]
	}
	switch {
	case len(f.known) > 0 && epoch > f.minKnown && !f.known[epoch]:
		v.add("%d@%d was committed by epoch %d, which never claimed the partition", f.p, o, epoch)
	case epoch < newest.epoch && !f.hist.keptByReexecution(f.p, o):
		v.add("%d@%d was committed by epoch %d after epoch %d had claimed the partition from offset %d", f.p, o, epoch, newest.epoch, newest.position)
	}
}
