package observe

import (
	"strings"

	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kfn-dev/kfn/outbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// This file holds the span helpers that need no lane: a record's trace
// context, ending a span with an error's status, and an error's first line
// for logs and span statuses. The spans of a lane are started by package
// engine (applier_trace.go).

// EndSpan ends span (nil: none) with err as its status.
func EndSpan(span trace.Span, err error) {
	if span == nil {
		return
	}
	if err != nil {
		span.SetStatus(codes.Error, FirstLine(err))
	}
	span.End()
}

// RecordTrace is the W3C trace context and baggage of a record's headers
// that kfn accepts, as a carrier for outbox.Propagator: empty fields when
// absent or invalid.
type RecordTrace struct{ Parent, State, Baggage string }

var _ propagation.TextMapCarrier = RecordTrace{}

// Get returns the value of the header key.
func (t RecordTrace) Get(key string) string {
	switch key {
	case outbox.HeaderTraceParent:
		return t.Parent
	case outbox.HeaderTraceState:
		return t.State
	case outbox.HeaderBaggage:
		return t.Baggage
	}
	return ""
}

// Set does nothing: a RecordTrace is read, never written.
func (RecordTrace) Set(string, string) {}

// Keys are the headers a RecordTrace holds.
func (RecordTrace) Keys() []string {
	return []string{outbox.HeaderTraceParent, outbox.HeaderTraceState, outbox.HeaderBaggage}
}

// TraceOf reads rec's trace context from its headers, whose bytes are
// whatever its producer sent: a traceparent if there is one valid value of
// it, with the tracestate if that is valid too; the baggage headers joined
// if they parse. It reports whether it dropped an invalid one.
func TraceOf(rec kfn.Record) (tc RecordTrace, dropped bool) {
	parents, states := 0, 0
	var parent, state []byte
	var bags []string
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
		case outbox.HeaderBaggage:
			bags = append(bags, string(h.Value))
		}
	}
	switch {
	case parents == 0:
	case dropped || !outbox.ValidTraceParent(string(parent)):
		dropped = true
	default:
		tc.Parent = string(parent)
		if states == 1 && outbox.ValidTraceState(string(state)) {
			tc.State = string(state)
		} else if states > 0 {
			dropped = true
		}
	}
	if len(bags) > 0 {
		if b := strings.Join(bags, ","); outbox.ValidBaggage(b) {
			tc.Baggage = b
		} else {
			dropped = true
		}
	}
	return tc, dropped
}

// FirstLine keeps log lines short: a panic's stack goes to the dead letter,
// not to the log.
func FirstLine(err error) string {
	line, _, _ := strings.Cut(err.Error(), "\n")
	return line
}
