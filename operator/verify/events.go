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
}

// maxEmits bounds the emit indexes tried to tell whether an event id is
// one kfn derives for its record (outbox.EventID).
const maxEmits = 64

// streamIdle is how long reading the stream waits for a next message
// before it takes the stream for read up to the cut (the messages up to
// it deleted or expired).
const streamIdle = 10 * time.Second

// streamEvents reads the function's events from the event stream up to
// the cut.
type streamEvents struct {
	stream  jetstream.Stream
	lastSeq uint64
	list    []event // sorted by record, then id, then sequence, once read
}

// read reads every message up to lastSeq and keeps those the function
// emitted for the topic, then checks that the events of each key come in
// their records' offset order.
func (s *streamEvents) read(ctx context.Context, spec Spec, generations map[int32]int, hist *history, vs *Violations, progress io.Writer) error {
	source := outbox.CloudEventsSourcePrefix + spec.Function
	err := scanStream(ctx, s.stream, spec.Stream, "", s.lastSeq, progress, func(msg jetstream.Msg, seq uint64) {
		h := msg.Headers()
		if h.Get(outbox.HeaderSource) != source || h.Get(outbox.HeaderSourceTopic) != spec.Topic {
			return
		}
		p, perr := strconv.ParseInt(h.Get(outbox.HeaderSourcePartition), 10, 32)
		o, oerr := strconv.ParseInt(h.Get(outbox.HeaderSourceOffset), 10, 64)
		id := h.Get(outbox.HeaderID)
		if perr != nil || oerr != nil || id == "" {
			vs.Unexpected.add("stream message %d on %s says it is an event of %s but lacks its source partition, offset or id", seq, msg.Subject(), spec.Function)
			return
		}
		e := event{seq: seq, p: int32(p), o: o, id: hashOf(id), key: hashOf(h.Get(outbox.HeaderKeyBase64) + "\x00" + h.Get(outbox.HeaderKey))}
		e.gen, e.idx = derive(spec.Function, spec.Topic, e.p, o, id, generations[e.p])
		s.list = append(s.list, e)
	})
	if err != nil {
		return err
	}
	s.byRecord()
	for i := 1; i < len(s.list); i++ {
		s.list[i].again = s.list[i].id == s.list[i-1].id && s.list[i].p == s.list[i-1].p && s.list[i].o == s.list[i-1].o
	}
	s.checkOrder(ctx, hist, &vs.OutOfOrder)
	s.byRecord()
	return nil
}

// scanStream calls fn with every message of stream (on subject filter,
// every subject when empty) up to sequence last, in order.
func scanStream(ctx context.Context, stream jetstream.Stream, name, filter string, last uint64, progress io.Writer, fn func(jetstream.Msg, uint64)) error {
	if last == 0 {
		return nil
	}
	cfg := jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy}
	if filter != "" {
		cfg.FilterSubjects = []string{filter}
	}
	cons, err := retryNATS(ctx, func() (jetstream.Consumer, error) { return stream.OrderedConsumer(ctx, cfg) })
	if err != nil {
		return fmt.Errorf("read the event stream %s: %w", name, err)
	}
	it, err := retryNATS(ctx, func() (jetstream.MessagesContext, error) { return cons.Messages(jetstream.PullMaxMessages(4096)) })
	if err != nil {
		return fmt.Errorf("read the event stream %s: %w", name, err)
	}
	defer it.Stop()
	lastProgress := time.Now()
	for n := 1; ; n++ {
		msg, err := it.Next(jetstream.NextMaxWait(streamIdle))
		if errors.Is(err, jetstream.ErrNoHeartbeat) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, jetstream.ErrMsgIteratorClosed) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read the event stream %s: %w", name, err)
		}
		meta, err := msg.Metadata()
		if err != nil {
			return fmt.Errorf("read the event stream %s: %w", name, err)
		}
		seq := meta.Sequence.Stream
		if seq > last {
			return nil
		}
		fn(msg, seq)
		if progress != nil && n%65536 == 0 && time.Since(lastProgress) > 2*time.Second {
			lastProgress = time.Now()
			fmt.Fprintf(progress, "kfn verify: stream %s: sequence %d of %d\n", name, seq, last)
		}
		if seq >= last || meta.NumPending == 0 {
			return nil
		}
	}
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
				v.add("the event %s for %d@%d comes after the event for %d@%d (stream seq %d) of the same key",
					s.text(ctx, *e), e.p, e.o, prev.p, prev.o, prev.seq)
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
// event function emitted for the record (outbox.EventID); index -1 when
// none up to the partition's current generation and maxEmits does.
func derive(function, topic string, p int32, o int64, id string, generations int) (gen, idx int16) {
	for g := 0; g <= generations; g++ {
		src := outbox.SourceID(topic, p, o, "", g)
		for i := 0; i < maxEmits; i++ {
			if outbox.EventID(function, src, i) == id {
				return int16(g), int16(i)
			}
		}
	}
	return 0, -1
}
