package engine

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/propagation"

	"github.com/kfn-dev/kfn/internal/observe"
	"github.com/kfn-dev/kfn/internal/pgdata"
	"github.com/kfn-dev/kfn/outbox"
	kfn "github.com/kfn-dev/kfn/runtime"
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
	// traced holds the trace context of each source record seen, by
	// source id, and traceDropped counts those whose trace context was
	// invalid and ignored (Stats.TraceContextDropped).
	traced       map[string]observe.RecordTrace
	traceDropped int
	// spans holds, by source id, the handler span each record's events
	// continue while tracing is on; a record without one (tracing off)
	// passes on its own trace context as it came.
	spans map[string]*handlerSpan
}

// handlerSpan is the span of a record's handler call, and the headers its
// events carry.
type handlerSpan struct {
	ctx     context.Context
	headers propagation.MapCarrier // injected from ctx on the first emit
}

func newEmitCollector(fn kfn.Function, generation int) *emitCollector {
	return &emitCollector{consumer: fn.Name, emits: fn.Emits, generation: generation, next: map[string]int{}, traced: map[string]observe.RecordTrace{}}
}

func (c *emitCollector) sourceID(rec kfn.Record) string {
	return outbox.SourceID(rec.Topic, rec.Partition, rec.Offset, rec.EventID, c.generation)
}

// trace returns the trace context of the record with sourceID (traceOf),
// read once per transaction.
func (c *emitCollector) trace(sourceID string, rec kfn.Record) observe.RecordTrace {
	if tc, ok := c.traced[sourceID]; ok {
		return tc
	}
	tc, dropped := observe.TraceOf(rec)
	if dropped {
		c.traceDropped++
	}
	c.traced[sourceID] = tc
	return tc
}

// traceIn starts the span of rec's handler call with start, from the
// trace context rec carries, and makes rec's events continue that span.
func (c *emitCollector) traceIn(rec kfn.Record, start func(observe.RecordTrace) context.Context) context.Context {
	id := c.sourceID(rec)
	ctx := start(c.trace(id, rec))
	if c.spans == nil {
		c.spans = map[string]*handlerSpan{}
	}
	c.spans[id] = &handlerSpan{ctx: ctx}
	return ctx
}

func (c *emitCollector) emit(rec kfn.Record, ev kfn.Event) {
	err := validateEvent(ev)
	if err == nil && !outbox.CoversSubject(c.emits, ev.Subject) {
		err = fmt.Errorf("event subject %q is not among the function's Emits %v: declare it there", ev.Subject, c.emits)
	}
	if err != nil {
		if c.err == nil {
			c.err = kfn.Permanent(fmt.Errorf("emit from %s: %w", rec, err))
		}
		return
	}
	sourceID := c.sourceID(rec)
	index := c.next[sourceID]
	c.next[sourceID] = index + 1
	origin := outbox.Origin{Consumer: c.consumer, Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset, SourceID: sourceID}
	if span := c.spans[sourceID]; span != nil {
		if span.headers == nil {
			span.headers = propagation.MapCarrier{}
			outbox.Propagator.Inject(span.ctx, span.headers)
		}
		origin.TraceParent, origin.TraceState, origin.Baggage = span.headers[outbox.HeaderTraceParent], span.headers[outbox.HeaderTraceState], span.headers[outbox.HeaderBaggage]
	} else { // no span: the record's own context, as it came
		tc := c.trace(sourceID, rec)
		origin.TraceParent, origin.TraceState, origin.Baggage = tc.Parent, tc.State, tc.Baggage
	}
	c.rows = append(c.rows, outbox.NewRow(origin, index, string(rec.Key), outbox.Event(ev)))
}

// validateEvent rejects events the outbox cannot store as given: a subject
// NATS cannot publish on, and a type or header that is not valid text.
func validateEvent(ev kfn.Event) error {
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
