package engine

import (
	"fmt"

	"github.com/kfn-dev/kfn/internal/pgdata"
	"github.com/kfn-dev/kfn/outbox"
)

// emitCollector gathers the outbox rows of one transaction. Each source
// record numbers its events from 0, so event ids are deterministic.
type emitCollector struct {
	consumer   string
	emits      []string // the function's declared subjects
	generation int      // the partition's re-execution count; see inbox.ReplayRequest
	rows       []outbox.Row
	next       map[string]int // next emit index per source record
	err        error          // first invalid event; fails the handler
	// traceChecked holds the source records whose trace context was
	// checked, and traceDropped counts those whose trace context was
	// invalid and not propagated (Stats.TraceContextDropped).
	traceChecked map[string]traceContext
	traceDropped int
}

// traceContext is a source record's W3C trace context as propagated to the
// events it emits: empty fields when absent or invalid.
type traceContext struct{ parent, state string }

func newEmitCollector(fn Function, generation int) *emitCollector {
	return &emitCollector{consumer: fn.Name, emits: fn.Emits, generation: generation, next: map[string]int{}}
}

func (c *emitCollector) emit(rec Record, ev Event) {
	err := validateEvent(ev)
	if err == nil && !outbox.CoversSubject(c.emits, ev.Subject) {
		err = fmt.Errorf("event subject %q is not among the function's Emits %v: declare it there", ev.Subject, c.emits)
	}
	if err != nil {
		if c.err == nil {
			c.err = Permanent(fmt.Errorf("emit from %s: %w", rec, err))
		}
		return
	}
	sourceID := outbox.SourceID(rec.Topic, rec.Partition, rec.Offset, rec.EventID, c.generation)
	index := c.next[sourceID]
	c.next[sourceID] = index + 1
	trace := c.traceContext(sourceID, rec)
	origin := outbox.Origin{
		Consumer: c.consumer, Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset,
		SourceID: sourceID, TraceParent: trace.parent, TraceState: trace.state,
	}
	c.rows = append(c.rows, outbox.NewRow(origin, index, string(rec.Key), ev))
}

// traceContext returns the W3C trace context of a source record that its
// events carry: its traceparent header if that is valid, with its tracestate
// header if that is valid too. A record's header bytes are whatever its
// producer sent; invalid ones are dropped, and counted once per record.
func (c *emitCollector) traceContext(sourceID string, rec Record) traceContext {
	if tc, ok := c.traceChecked[sourceID]; ok {
		return tc
	}
	var tc traceContext
	dropped := false
	parents, states := 0, 0
	var parent, state []byte
	for _, h := range rec.Headers {
		switch h.Key {
		case outbox.HeaderTraceParent:
			parents++
			if parents == 1 {
				parent = h.Value
			} else if string(h.Value) != string(parent) {
				dropped = true // conflicting traceparents: no trace context
			}
		case outbox.HeaderTraceState:
			states++
			state = h.Value
		}
	}
	switch {
	case parents == 0:
	case dropped || !outbox.ValidTraceParent(string(parent)):
		dropped = true
	default:
		tc.parent = string(parent)
		if states == 1 && outbox.ValidTraceState(string(state)) {
			tc.state = string(state)
		} else if states > 0 {
			dropped = true
		}
	}
	if dropped {
		c.traceDropped++
	}
	if c.traceChecked == nil {
		c.traceChecked = map[string]traceContext{}
	}
	c.traceChecked[sourceID] = tc
	return tc
}

// validateEvent rejects events the outbox cannot store as given: a subject
// NATS cannot publish on, and a type or header that is not valid text.
func validateEvent(ev Event) error {
	if err := outbox.CheckSubject(ev.Subject); err != nil {
		return err
	}
	if !pgdata.ValidText(ev.Type) {
		return fmt.Errorf("event type %q is not valid UTF-8 text without NUL bytes", ev.Type)
	}
	for k, v := range ev.Headers {
		if !pgdata.ValidText(k) || !pgdata.ValidText(v) {
			return fmt.Errorf("event header %q: %q is not valid UTF-8 text without NUL bytes (put binary data in the event's Data)", k, v)
		}
	}
	return nil
}
