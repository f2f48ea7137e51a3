package engine

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/propagation"

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
	// traced holds the trace of each source record seen, by source id, and
	// traceDropped counts those whose trace context was invalid and not
	// propagated (Stats.TraceContextDropped).
	traced       map[string]tracedRecord
	traceDropped int
}

// tracedRecord is how a source record's events continue its trace.
type tracedRecord struct {
	tc recordTrace // what the record's headers carried
	// ctx holds the span the record's events continue (its handler's),
	// or nil (tracing off): then they carry tc as it came.
	ctx     context.Context
	headers propagation.MapCarrier // injected from ctx on the first emit
}

func newEmitCollector(fn Function, generation int) *emitCollector {
	return &emitCollector{consumer: fn.Name, emits: fn.Emits, generation: generation, next: map[string]int{}, traced: map[string]tracedRecord{}}
}

func (c *emitCollector) sourceID(rec Record) string {
	return outbox.SourceID(rec.Topic, rec.Partition, rec.Offset, rec.EventID, c.generation)
}

// trace returns the trace of the record with sourceID (traceOf), read
// once per transaction.
func (c *emitCollector) trace(sourceID string, rec Record) tracedRecord {
	if t, ok := c.traced[sourceID]; ok {
		return t
	}
	tc, dropped := traceOf(rec)
	if dropped {
		c.traceDropped++
	}
	t := tracedRecord{tc: tc}
	c.traced[sourceID] = t
	return t
}

// traceIn starts the span of rec's handler call with start, from the
// trace context rec carries, and makes rec's events continue that span.
func (c *emitCollector) traceIn(rec Record, start func(recordTrace) context.Context) context.Context {
	id := c.sourceID(rec)
	t := c.trace(id, rec)
	t.ctx = start(t.tc)
	c.traced[id] = t
	return t.ctx
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
	sourceID := c.sourceID(rec)
	index := c.next[sourceID]
	c.next[sourceID] = index + 1
	origin := outbox.Origin{Consumer: c.consumer, Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset, SourceID: sourceID}
	switch t := c.trace(sourceID, rec); {
	case t.ctx == nil: // no span: the record's own context, as it came
		origin.TraceParent, origin.TraceState, origin.Baggage = t.tc.parent, t.tc.state, t.tc.baggage
	default:
		if t.headers == nil {
			t.headers = propagation.MapCarrier{}
			outbox.Propagator.Inject(t.ctx, t.headers)
			c.traced[sourceID] = t
		}
		origin.TraceParent, origin.TraceState, origin.Baggage = t.headers[outbox.HeaderTraceParent], t.headers[outbox.HeaderTraceState], t.headers[outbox.HeaderBaggage]
	}
	c.rows = append(c.rows, outbox.NewRow(origin, index, string(rec.Key), ev))
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
