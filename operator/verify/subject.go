package verify

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/naming"
	"github.com/kfn-dev/kfn/outbox"
)

// trigger is what is kept of one event on a NATS-triggered function's
// subject: its id in the event inbox, its stream sequence, its lane, and
// its key when the keyed effects shape needs it.
type trigger struct {
	id   string
	seq  uint64
	lane int32
	key  string
}

// runSubject verifies a NATS-triggered function: the events on its
// subject in the event stream against its lanes' cursors, its event inbox
// (which holds its dead-lettered events too) and its effects. The snapshot
// comes first here and the stream after it: every lane's cursor is then
// at or below the stream's last sequence.
func runSubject(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, spec Spec, rep *Report, start time.Time) (*Report, error) {
	if spec.ranged() {
		return nil, specError(spec.rangeFlag(), "a range applies to Kafka-sourced functions: %s is the NATS subject of %q, a NATS-triggered function, which is checked whole; leave out --partitions, --from and --to", spec.Topic, spec.Function)
	}
	if js == nil {
		return nil, specError("nats-url", "%s is the NATS subject of %q, a NATS-triggered function, whose events are read from the event stream: give the NATS server", spec.Topic, spec.Function)
	}
	rep.Source = "NATS subject " + spec.Topic
	tx, exported, cursors, err := openSnapshot(ctx, pool, rep, spec)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // read-only
	lanes := 1
	if err := tx.QueryRow(ctx, `SELECT coalesce((SELECT lanes FROM kfn.subject_lanes WHERE consumer = $1 AND subject = $2), 1)`,
		spec.Function, spec.Topic).Scan(&lanes); err != nil {
		return nil, fmt.Errorf("read the lanes of %s: %w", spec.Function, err)
	}
	eff, hist, err := readEffectsAndHistory(ctx, tx, spec, rep, true)
	if err != nil {
		return nil, err
	}
	stream, info, err := openEventStream(ctx, js, spec)
	if err != nil {
		return nil, err
	}
	first, last := info.State.FirstSeq, info.State.LastSeq
	rep.Cut.Stream = &StreamCut{Name: spec.Stream, LastSeq: last}
	if first > 1 {
		if eff.shape == shapeKeyed || eff.shape == shapeTotal {
			return nil, specError("effects-sql", "the query returns counts, which are compared with every event on %s since sequence 1, but stream %s holds events only from sequence %d: return one row per applied event (event_id) instead",
				spec.Topic, spec.Stream, first)
		}
		rep.Cut.Notes = append(rep.Cut.Notes, fmt.Sprintf("stream %s holds events from sequence %d: event inbox rows of earlier events are not compared, and an effect of one with no event inbox row is not told from an unexpected one (not counted)", spec.Stream, first))
	}
	if eff.shape == shapeKeyed || eff.shape == shapeTotal {
		if err := eff.readCounts(ctx, tx); err != nil {
			return nil, err
		}
	}
	generations := map[int32]int{}
	for _, c := range cursors {
		generations[c.partition] = c.generation
	}
	evs, events, err := readSubject(ctx, stream, spec, eff, lanes, last, generations, hist, &rep.Violations)
	if err != nil {
		return nil, err
	}
	rep.Checked.Events = int64(len(events.list))

	w := &walk{spec: spec, rep: rep, eff: eff, hist: hist, events: events, started: time.Now(), lastProgress: time.Now()}
	if err := w.runEvents(ctx, pool, exported, evs, cursors, lanes, first, last); err != nil {
		return nil, err
	}
	if err := checkOutbox(ctx, tx, spec, nil, rep); err != nil {
		return nil, err
	}
	rep.Cut.Statement = fmt.Sprintf("the events on %s in stream %s up to sequence %d, read after the snapshot, below their lane's cursor "+
		"(%d lanes by key hash; the larger of next_offset and high_water) in the Postgres snapshot; events from the cursor on are pending. "+
		"The partitions are the lanes, and kafka_first and kafka_high the stream's first sequence and its last plus one; "+
		"the function's own events in the stream up to the same sequence",
		spec.Topic, spec.Stream, last, lanes)
	return rep.done(start), nil
}

// readSubject reads the stream up to the cut once: the events on the
// subject (in stream order, then sorted by id) and the function's own
// events, emitted while handling them. An own event's source is the
// event on the subject at its source offset (read before it: it was
// published after its source was handled); its lane is the source's, and
// its id is checked against those kfn derives from the source's id.
func readSubject(ctx context.Context, stream jetstream.Stream, spec Spec, eff *effects, lanes int, last uint64,
	generations map[int32]int, hist *history, vs *Violations) ([]trigger, *streamEvents, error) {
	events := &streamEvents{stream: stream, lastSeq: last, subject: true}
	source := outbox.CloudEventsSourcePrefix + spec.Function
	subject := []string{spec.Topic}
	var evs []trigger
	err := scanStream(ctx, stream, spec.Stream, "", last, spec.Progress, func(msg jetstream.Msg, seq uint64) {
		if e, id, ok := events.parse(msg, seq, spec, source, vs); ok {
			e.gen, e.idx = 0, -1
			i, found := slices.BinarySearchFunc(evs, uint64(e.o), func(t trigger, seq uint64) int { return cmp.Compare(t.seq, seq) })
			if found && e.o >= 0 {
				t := evs[i]
				e.p = t.lane
				e.gen, e.idx = derive(spec.Function, spec.Topic, 0, e.o, t.id, id, generations[t.lane])
			} else {
				e.p = -1 // no event on the subject there
			}
			events.list = append(events.list, e)
			return
		}
		if !outbox.CoversSubject(subject, msg.Subject()) {
			return
		}
		h := msg.Headers()
		key := naming.EventKey(h)
		t := trigger{id: naming.EventID(h, spec.Stream, int64(seq)), seq: seq, lane: int32(outbox.LaneOf(key, lanes))}
		if eff.shape == shapeKeyed {
			t.key = string(key)
		}
		evs = append(evs, t)
	})
	if err != nil {
		return nil, nil, err
	}
	events.finish(ctx, hist, vs)
	slices.SortFunc(evs, func(a, b trigger) int { return cmp.Or(cmp.Compare(a.id, b.id), cmp.Compare(a.seq, b.seq)) })
	return evs, events, nil
}

// runEvents merges the events on the subject, sorted by id, with what
// Postgres holds for each id (its event inbox row and effects), and finds
// the function's own events of each by its lane and sequence.
func (w *walk) runEvents(ctx context.Context, pool *pgxpool.Pool, snapshot string, evs []trigger, cursors []cursor, lanes int, first, last uint64) error {
	pg, err := openEventRecords(ctx, pool, snapshot, w.spec, w.eff)
	if err != nil {
		return err
	}
	w.pg = pg
	defer pg.close(ctx)
	w.initKeys()
	bounds := make([]int64, lanes) // 0 without a cursor: every event pending
	fences := make([]*fence, lanes)
	for lane := range lanes {
		fences[lane] = newFence(int32(lane), w.hist, -1)
	}
	for _, c := range cursors {
		if int(c.partition) < lanes {
			bounds[c.partition] = c.bound()
			fences[c.partition] = newFence(c.partition, w.hist, c.epoch)
		}
	}
	pending := make([]int64, lanes)
	w.nextRow()
	for i := 0; i < len(evs); {
		e := evs[i] // the first copy of the event in the stream: the one its lane handled first
		for i < len(evs) && evs[i].id == e.id {
			i++ // later copies: republished, the inbox skips them
		}
		w.eventOrphansBefore(e.id, first)
		var r *pgRow
		if w.rowOK && w.row.id == e.id {
			row := w.row
			r = &row
			w.nextRow()
		}
		own := w.events.of(e.lane, int64(e.seq))
		bound := bounds[e.lane]
		if int64(e.seq) >= bound {
			pending[e.lane]++ // its own events may come from a transaction after the snapshot
			continue
		}
		w.rep.Checked.Records++
		where := position{p: e.lane, o: int64(e.seq), id: e.id}
		redone := w.hist.reexecutions(e.lane, int64(e.seq))
		applied := w.judge(r, []byte(e.key), redone, where, bound)
		if r != nil && r.epoch != nil && r.sameLanes {
			fences[e.lane].check(r.seq, *r.epoch, &w.rep.Violations.FencedButCommitted)
		}
		w.checkEvents(ctx, where, r, applied, redone, own)
	}
	for w.rowOK {
		w.eventOrphan(first)
	}
	if w.rowErr != nil {
		return fmt.Errorf("read the event inbox of %s: %w", w.spec.Function, w.rowErr)
	}
	w.ownOrphans(ctx, first)
	w.finishCounts()
	for lane := range lanes {
		w.rep.Cut.Partitions = append(w.rep.Cut.Partitions, PartitionCut{Partition: int32(lane), KafkaFirst: int64(first), KafkaHigh: int64(last) + 1,
			Cursor: -1, HighWater: -1, CheckedFrom: int64(first), CheckedBelow: bounds[lane], Pending: pending[lane]})
	}
	for _, c := range cursors {
		if int(c.partition) < lanes {
			pc := &w.rep.Cut.Partitions[c.partition]
			pc.Cursor, pc.HighWater = c.next, c.high
		}
	}
	return nil
}

// ownOrphans reports the function's own events that no event on the
// subject in the stream is the source of (unless the stream no longer
// holds their source).
func (w *walk) ownOrphans(ctx context.Context, first uint64) {
	v := &w.rep.Violations.Unexpected
	for _, e := range w.events.list {
		if e.matched || e.o < int64(first) {
			continue
		}
		if v.room() {
			v.add("event %s claims to be for the event at stream seq %d, but there is no event on %s there", w.events.text(ctx, e), e.o, w.spec.Topic)
		} else {
			v.Count++
		}
	}
}

// eventOrphansBefore reports the rows before event id id that no event in
// the stream matched.
func (w *walk) eventOrphansBefore(id string, first uint64) {
	for w.rowOK && w.row.id < id {
		w.eventOrphan(first)
	}
}

// eventOrphan reports the current row, which no event in the stream
// matched, unless the stream no longer holds the events it could be for.
func (w *walk) eventOrphan(first uint64) {
	r := w.row
	w.nextRow()
	switch {
	case r.epoch != nil && r.seq < int64(first):
	case r.epoch == nil && first > 1:
	default:
		w.rep.Violations.Unexpected.add("event %s has %s, but stream %s has no such event on %s", r.id, r.what(), w.spec.Stream, w.spec.Topic)
	}
}
