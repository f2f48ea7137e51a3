package verify

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/outbox"
)

// event is what is kept of one of the function's events in the stream:
// its source record, a hash of its id, and the generation and emit index
// its id derives from (index -1: kfn derives no such id for the record).
type event struct {
	seq uint64
	p   int32
	o   int64
	id  uint64
	key uint64 // a hash of the event's key
	gen int16
	idx int16
	// again: an earlier message in the stream has the same id.
	again bool
	// matched: a NATS-triggered function's event whose source event was
	// found on the subject (of).
	matched bool
}

// maxEmits bounds the emit indexes tried to tell whether an event id is
// one kfn derives for its record (outbox.EventID).
const maxEmits = 64

// streamIdle is how long reading the stream waits for a next message
// before it asks the stream whether one is left to read up to the cut.
const streamIdle = 10 * time.Second

// streamStall is how long reading the stream goes on without a message
// while the stream says one is left up to the cut (a NATS node lost, its
// leaders being elected) before it is an error.
const streamStall = time.Minute

// streamEvents reads the function's events from the event stream up to
// the cut.
type streamEvents struct {
	stream  jetstream.Stream
	lastSeq uint64
	list    []event // sorted by record, then id, then sequence, once read
	// subject: the function is NATS-triggered, its records are the events
	// on its subject (an event's p is their lane, o their sequence).
	subject bool
}

// read reads every message up to lastSeq and keeps those the function
// emitted for the records of the topic in sc, then checks that the events
// of each key come in their records' offset order.
func (s *streamEvents) read(ctx context.Context, spec Spec, sc *scope, generations map[int32]int, hist *history, vs *Violations, progress io.Writer) error {
	source := outbox.CloudEventsSourcePrefix + spec.Function
	err := scanStream(ctx, s.stream, spec.Stream, "", s.lastSeq, progress, func(msg jetstream.Msg, seq uint64) {
		if e, id, ok := s.parse(msg, seq, spec, source, vs); ok && sc.has(e.p, e.o) {
			e.gen, e.idx = derive(spec.Function, spec.Topic, e.p, e.o, "", id, generations[e.p])
			s.list = append(s.list, e)
		}
	})
	if err != nil {
		return err
	}
	s.finish(ctx, hist, vs)
	return nil
}

// parse reads msg, at stream sequence seq, as an event of the function
// (its ce-source is source) emitted while handling a record of spec.Topic
// (a subject of it, for a NATS-triggered function), and returns it, with
// its id; false for any other message. One that says it is such an event
// but lacks its source or id is unexpected.
func (s *streamEvents) parse(msg jetstream.Msg, seq uint64, spec Spec, source string, vs *Violations) (event, string, bool) {
	h := msg.Headers()
	if h.Get(outbox.HeaderSource) != source {
		return event{}, "", false
	}
	if topic := h.Get(outbox.HeaderSourceTopic); topic != spec.Topic && !outbox.CoversSubject([]string{spec.Topic}, topic) {
		return event{}, "", false
	}
	p, perr := strconv.ParseInt(h.Get(outbox.HeaderSourcePartition), 10, 32)
	o, oerr := strconv.ParseInt(h.Get(outbox.HeaderSourceOffset), 10, 64)
	id := h.Get(outbox.HeaderID)
	if perr != nil || oerr != nil || id == "" {
		vs.Unexpected.add("stream message %d on %s says it is an event of %s but lacks its source partition, offset or id", seq, msg.Subject(), spec.Function)
		return event{}, "", false
	}
	return event{seq: seq, p: int32(p), o: o, id: hashOf(id), key: hashOf(h.Get(outbox.HeaderKeyBase64) + "\x00" + h.Get(outbox.HeaderKey))}, id, true
}

// finish marks the copies of an event, checks the order of the events
// of each key, and leaves them sorted by record.
func (s *streamEvents) finish(ctx context.Context, hist *history, vs *Violations) {
	s.byRecord()
	for i := 1; i < len(s.list); i++ {
		s.list[i].again = s.list[i].id == s.list[i-1].id && s.list[i].p == s.list[i-1].p && s.list[i].o == s.list[i-1].o
	}
	s.checkOrder(ctx, hist, &vs.OutOfOrder)
	s.byRecord()
}

// scanStream calls fn with every message of stream (on subject filter,
// every subject when empty) up to sequence last, in order. It never stops
// short silently: when no message comes for streamIdle, it asks the stream
// whether one is left up to the cut, and reads on from where it was if
// so, until streamStall without a message.
func scanStream(ctx context.Context, stream jetstream.Stream, name, filter string, last uint64, progress io.Writer, fn func(jetstream.Msg, uint64)) error {
	sc := &streamScan{stream: stream, name: name, filter: filter, last: last, next: 1, progress: progress, fn: fn, moved: time.Now()}
	for sc.next <= last {
		done, err := sc.read(ctx)
		if done || err != nil {
			return err
		}
		left, err := sc.left(ctx)
		if err != nil || !left {
			return err
		}
		if time.Since(sc.moved) > streamStall {
			return fmt.Errorf("read the event stream %s: no message from sequence %d, below the cut %d, for %s", name, sc.next, last, streamStall)
		}
	}
	return nil
}

// streamScan is one scanStream: the next sequence it wants, and when it
// last got a message.
type streamScan struct {
	stream       jetstream.Stream
	name, filter string
	last, next   uint64
	progress     io.Writer
	fn           func(jetstream.Msg, uint64)
	moved        time.Time
	lastProgress time.Time
	n            int
}

// read reads with an ordered consumer from sc.next until the cut (done)
// or streamIdle without a message. The messages come to a handler (one at
// a time, in order), which spares a timer and a heartbeat check per
// message that an iterator's Next takes. The handler works under mu until
// read stops it: from then on read owns sc again, whatever the
// consumption still delivers (a server gone may keep it from closing).
func (sc *streamScan) read(ctx context.Context) (done bool, err error) {
	cfg := jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy}
	if sc.next > 1 {
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, sc.next
	}
	if sc.filter != "" {
		cfg.FilterSubjects = []string{sc.filter}
	}
	cons, err := retryNATS(ctx, func() (jetstream.Consumer, error) { return sc.stream.OrderedConsumer(ctx, cfg) })
	if err != nil {
		return false, fmt.Errorf("read the event stream %s: %w", sc.name, err)
	}
	end := make(chan error, 1) // the handler's end (one at most): nil at the cut
	var got atomic.Int64       // messages handled, for the idle check
	var mu sync.Mutex
	finished := false // under mu
	handle := func(msg jetstream.Msg) {
		mu.Lock()
		defer mu.Unlock()
		if finished {
			return
		}
		meta, err := msg.Metadata()
		if err != nil {
			finished = true
			end <- fmt.Errorf("read the event stream %s: %w", sc.name, err)
			return
		}
		seq := meta.Sequence.Stream
		if seq > sc.last {
			finished = true
			end <- nil
			return
		}
		sc.fn(msg, seq)
		sc.next = seq + 1
		got.Add(1)
		if sc.n++; sc.progress != nil && sc.n%65536 == 0 && time.Since(sc.lastProgress) > 2*time.Second {
			sc.lastProgress = time.Now()
			fmt.Fprintf(sc.progress, "kfn verify: stream %s: sequence %d of %d\n", sc.name, seq, sc.last)
		}
		if seq >= sc.last || meta.NumPending == 0 {
			finished = true
			end <- nil
		}
	}
	cc, err := retryNATS(ctx, func() (jetstream.ConsumeContext, error) {
		// Its errors (missed heartbeats, a server gone) are the ordered
		// consumer's to recover from; a stall is the idle check's.
		return cons.Consume(handle, jetstream.PullMaxMessages(4096), jetstream.ConsumeErrHandler(func(jetstream.ConsumeContext, error) {}))
	})
	if err != nil {
		return false, fmt.Errorf("read the event stream %s: %w", sc.name, err)
	}
	stop := func() {
		cc.Stop()
		mu.Lock()
		finished = true
		mu.Unlock()
	}
	idle := time.NewTicker(streamIdle)
	defer idle.Stop()
	var seen int64
	started, moved := time.Now(), sc.moved // moved: when a message was last seen to have come
	for {
		select {
		case err := <-end:
			stop()
			return err == nil, err
		case <-ctx.Done():
			stop()
			return false, ctx.Err()
		case <-idle.C:
			if n := got.Load(); n != seen {
				seen, moved = n, time.Now()
				continue
			}
			stop()
			select {
			case err := <-end: // it ended as it was stopped
				return err == nil, err
			default:
			}
			if got.Load() > 0 && moved.Before(started) {
				moved = started
			}
			sc.moved = moved
			return false, nil
		}
	}
}

// left reports whether the stream holds a message from sc.next up to the
// cut: its last one (on the filter) is there.
func (sc *streamScan) left(ctx context.Context) (bool, error) {
	var lastSeq uint64
	if sc.filter == "" {
		info, err := retryNATS(ctx, func() (*jetstream.StreamInfo, error) { return sc.stream.Info(ctx) })
		if err != nil {
			return false, fmt.Errorf("read the event stream %s: %w", sc.name, err)
		}
		if info.State.Msgs == 0 {
			return false, nil
		}
		lastSeq = info.State.LastSeq
	} else {
		msg, err := retryNATS(ctx, func() (*jetstream.RawStreamMsg, error) { return sc.stream.GetLastMsgForSubject(ctx, sc.filter) })
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("read the event stream %s: %w", sc.name, err)
		}
		lastSeq = msg.Sequence
	}
	return lastSeq >= sc.next, nil
}

// of returns the events of record o of partition p (for a NATS-triggered
// function: of the event at stream sequence o, in lane p), sorted by id,
// and marks them matched.
func (s *streamEvents) of(p int32, o int64) []event {
	i, _ := slices.BinarySearchFunc(s.list, event{p: p, o: o}, func(a, b event) int { return cmp.Or(cmp.Compare(a.p, b.p), cmp.Compare(a.o, b.o)) })
	j := i
	for j < len(s.list) && s.list[j].p == p && s.list[j].o == o {
		s.list[j].matched = true
		j++
	}
	return s.list[i:j]
}

// byRecord sorts the events by record, then id, then stream sequence.
func (s *streamEvents) byRecord() {
	slices.SortFunc(s.list, func(a, b event) int {
		return cmp.Or(cmp.Compare(a.p, b.p), cmp.Compare(a.o, b.o), cmp.Compare(a.id, b.id), cmp.Compare(a.seq, b.seq))
	})
}

// checkOrder reports the events that the stream holds after an event of
// the same key (and generation: a re-execution emits its records again,
// after later ones) for a higher offset of the same partition. Copies of
// an event, events under ids kfn did not derive and events of records a
// dead letter retry applied (late, on purpose) are left out.
func (s *streamEvents) checkOrder(ctx context.Context, hist *history, v *Violation) {
	slices.SortFunc(s.list, func(a, b event) int {
		return cmp.Or(cmp.Compare(a.key, b.key), cmp.Compare(a.gen, b.gen), cmp.Compare(a.p, b.p), cmp.Compare(a.seq, b.seq))
	})
	var prev *event
	for i := range s.list {
		e := &s.list[i]
		if e.again || e.idx < 0 || hist.wasRetried(e.p, e.o) {
			continue
		}
		if prev == nil || prev.key != e.key || prev.gen != e.gen || prev.p != e.p {
			prev = e
			continue
		}
		if e.o < prev.o {
			if v.room() {
				v.add("the event %s for %s comes after the event for %s (stream seq %d) of the same key",
					s.text(ctx, *e), s.source(*e), s.source(*prev), prev.seq)
			} else {
				v.Count++
			}
			continue
		}
		prev = e
	}
}

// text describes an event for an example: its sequence, id, subject and
// key, read back from the stream.
func (s *streamEvents) text(ctx context.Context, e event) string {
	msg, err := s.stream.GetMsg(ctx, e.seq)
	if err != nil {
		return fmt.Sprintf("(stream seq %d)", e.seq)
	}
	return fmt.Sprintf("%s on %s (stream seq %d, key %q)", msg.Header.Get(outbox.HeaderID), msg.Subject, e.seq,
		eventKey(msg.Header.Get(outbox.HeaderKey), msg.Header.Get(outbox.HeaderKeyBase64)))
}

// source names the record an event was emitted for, in an example.
func (s *streamEvents) source(e event) string {
	if s.subject {
		return fmt.Sprintf("the event at stream seq %d (lane %d)", e.o, e.p)
	}
	return fmt.Sprintf("%d@%d", e.p, e.o)
}

func eventKey(key, b64 string) string {
	if b64 != "" {
		return "base64:" + b64
	}
	return key
}

func hashOf(s string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(s)) //nolint:errcheck // a hash does not fail
	return h.Sum64()
}

// derive finds the generation and emit index that make id the id of an
// event function emitted for the record (outbox.EventID; eventID is the
// record's event id when it is a NATS event); index -1 when none up to the
// partition's current generation and maxEmits does.
func derive(function, topic string, p int32, o int64, eventID, id string, generations int) (gen, idx int16) {
	for g := 0; g <= generations; g++ {
		src := outbox.SourceID(topic, p, o, eventID, g)
		for i := 0; i < maxEmits; i++ {
			if outbox.EventID(function, src, i) == id {
				return int16(g), int16(i)
			}
		}
	}
	return 0, -1
}
