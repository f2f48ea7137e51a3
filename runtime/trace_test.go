package runtime_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/baggage"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime"
)

// TestGarbageTraceHeadersAreIgnoredAndTheRecordStartsANewTrace: records
// whose traceparent, tracestate or baggage headers are garbage are applied
// like any other; their handler span is a child of their batch span (a new
// trace), and the invalid headers are counted. A valid trace context is
// continued (the handler span's parent is the producer's span, linked to
// the batch), with its baggage, even next to a garbage baggage header
// being dropped. An author's own span started from the handler's ctx nests
// under the handler span, and each event carries the handler span's
// context.
func TestGarbageTraceHeadersAreIgnoredAndTheRecordStartsANewTrace(t *testing.T) {
	b := setup(t, 1)
	b.cfg.NoRelay = true
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	b.cfg.TracerProvider = tp

	const (
		producerTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
		producerSpan  = "00f067aa0ba902b7"
		parent        = "00-" + producerTrace + "-" + producerSpan + "-01"
	)
	h := func(kv ...string) []kafka.Header {
		var out []kafka.Header
		for i := 0; i < len(kv); i += 2 {
			out = append(out, kafka.Header{Key: kv[i], Value: []byte(kv[i+1])})
		}
		return out
	}
	msgs := []kafka.Message{
		{Value: []byte("garbage-parent"), Headers: h("traceparent", "\xff\xfe\x00-not-a-trace", "baggage", "\x00\x01=;")},
		{Value: []byte("upper-parent"), Headers: h("traceparent", "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01", "tracestate", "=\xff")},
		{Value: []byte("bad-baggage"), Headers: h("traceparent", parent, "baggage", "k=v;;=bad, ,=\x00")},
		{Value: []byte("none")},
		{Value: []byte("valid"), Headers: h("traceparent", parent, "tracestate", "vendor=x1", "baggage", "tenant=acme,user=u%201")},
	}
	b.kafka.Produce(t, b.topic, msgs...)
	fn := effects.Function(b.fn, b.topic)
	apply := fn.Handler
	fn.Handler = func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
		ctx, span := tp.Tracer("author").Start(ctx, "author.work")
		defer span.End()
		return apply(ctx, tx, rec, out)
	}
	w, stop := b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	produced := make([]effects.Produced, len(msgs))
	for i := range produced {
		produced[i] = effects.Produced{Partition: 0, Offset: int64(i)}
	}
	b.check(t, b.fn, produced)
	if n := w.Stats().TraceContextDropped.Load(); n != 3 {
		t.Errorf("trace context dropped = %d, want 3 (the garbage traceparent, the uppercase one, the garbage baggage)", n)
	}

	byID := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	handlers := map[int64]sdktrace.ReadOnlySpan{}
	for _, s := range spans.Ended() {
		byID[s.SpanContext().SpanID()] = s
		if s.Name() == "process "+b.topic {
			handlers[attr(s, "messaging.kafka.offset")] = s
		}
	}
	for off := range int64(len(msgs)) {
		hs, ok := handlers[off]
		if !ok {
			t.Fatalf("no %q span for offset %d", "process "+b.topic, off)
		}
		checkMessagingAttrs(t, hs, map[string]string{
			"messaging.system": "kafka", "messaging.operation.type": "process", "messaging.operation.name": "process",
			"messaging.destination.name": b.topic, "messaging.destination.partition.id": "0",
			"messaging.consumer.group.name": b.fn, "messaging.kafka.offset": fmt.Sprint(off), "kfn.attempt": "1",
		})
		if hs.SpanKind() != trace.SpanKindConsumer {
			t.Errorf("offset %d: handler span kind %v, want consumer", off, hs.SpanKind())
		}
		parentSpan := byID[hs.Parent().SpanID()]
		continued := off == 2 || off == 4
		switch {
		case continued:
			if hs.SpanContext().TraceID().String() != producerTrace || hs.Parent().SpanID().String() != producerSpan || !hs.Parent().IsRemote() {
				t.Errorf("offset %d: handler span in trace %s under %s, want the producer's trace %s under %s",
					off, hs.SpanContext().TraceID(), hs.Parent().SpanID(), producerTrace, producerSpan)
			}
			if links := hs.Links(); len(links) != 1 || byID[links[0].SpanContext.SpanID()] == nil || byID[links[0].SpanContext.SpanID()].Name() != "kfn.batch" {
				t.Errorf("offset %d: handler span links %v, want its kfn.batch span", off, links)
			}
		case parentSpan == nil || parentSpan.Name() != "kfn.batch" || hs.SpanContext().TraceID() != parentSpan.SpanContext().TraceID():
			t.Errorf("offset %d: handler span's parent %v is not its kfn.batch span", off, hs.Parent())
		case hs.SpanContext().TraceID().String() == producerTrace || len(hs.Links()) != 0:
			t.Errorf("offset %d: handler span in trace %s with links %v, want a new trace without links", off, hs.SpanContext().TraceID(), hs.Links())
		}
		var author sdktrace.ReadOnlySpan
		for _, s := range spans.Ended() {
			if s.Name() == "author.work" && s.Parent().SpanID() == hs.SpanContext().SpanID() {
				author = s
			}
		}
		if author == nil || author.SpanContext().TraceID() != hs.SpanContext().TraceID() {
			t.Errorf("offset %d: no author.work span under the handler span", off)
		}
	}

	for off, h := range b.outboxHeaders(t, len(msgs)) {
		hs := handlers[off].SpanContext()
		if want := fmt.Sprintf("00-%s-%s-01", hs.TraceID(), hs.SpanID()); h["traceparent"] != want {
			t.Errorf("offset %d: event traceparent %q, want the handler span's %q", off, h["traceparent"], want)
		}
		wantState, wantBaggage := "", map[string]string{}
		if off == 4 {
			wantState, wantBaggage = "vendor=x1", map[string]string{"tenant": "acme", "user": "u 1"}
		}
		if h["tracestate"] != wantState {
			t.Errorf("offset %d: event tracestate %q, want %q", off, h["tracestate"], wantState)
		}
		bag, err := baggage.Parse(h["baggage"])
		got := map[string]string{}
		for _, m := range bag.Members() {
			got[m.Key()] = m.Value()
		}
		if err != nil || fmt.Sprint(got) != fmt.Sprint(wantBaggage) {
			t.Errorf("offset %d: event baggage %q (%v), want %v", off, h["baggage"], err, wantBaggage)
		}
	}
}

// checkMessagingAttrs checks that span s has the attributes want (by
// their values' Emit form) and none of the kfn.* ones the messaging
// conventions replace.
func checkMessagingAttrs(t *testing.T, s sdktrace.ReadOnlySpan, want map[string]string) {
	t.Helper()
	got := map[string]string{}
	for _, kv := range s.Attributes() {
		got[string(kv.Key)] = kv.Value.Emit()
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("span %q: attribute %s = %q, want %q (all: %v)", s.Name(), k, got[k], v, got)
		}
	}
	for _, k := range []string{"kfn.function", "kfn.topic", "kfn.partition", "kfn.offset", "kfn.event_id"} {
		if _, ok := got[k]; ok {
			t.Errorf("span %q has %s, which a messaging.* attribute replaces (all: %v)", s.Name(), k, got)
		}
	}
}

// attr returns an int attribute of s, or -1.
func attr(s sdktrace.ReadOnlySpan, key string) int64 {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value.AsInt64()
		}
	}
	return -1
}

// TestBatchHandlerCallIsOneSpanOverOneSpanPerRecord: a BatchHandler's
// call is one "process <topic>" span under the batch span (with
// messaging.batch.message_count), over one "process <topic>" span per
// record (with messaging.kafka.offset): child of the record's trace
// context (linked to the call's span) when it has one, else of the call's
// span. Each record's event continues its record span, so traces go on
// through batch handlers.
func TestBatchHandlerCallIsOneSpanOverOneSpanPerRecord(t *testing.T) {
	b := setup(t, 1)
	b.cfg.NoRelay = true
	spans := tracetest.NewSpanRecorder()
	b.cfg.TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	b.kafka.Produce(t, b.topic,
		kafka.Message{Value: []byte("traced"), Headers: []kafka.Header{{Key: "traceparent", Value: []byte(parent)}}},
		kafka.Message{Value: []byte("plain")},
	)
	_, stop := b.run(t, effects.BatchFunction(b.fn, b.topic))
	b.waitCaughtUp(t, b.fn)
	stop()

	var handler sdktrace.ReadOnlySpan
	batches := map[trace.SpanID]bool{}
	records := map[int64]sdktrace.ReadOnlySpan{}
	for _, s := range spans.Ended() {
		switch {
		case s.Name() == "process "+b.topic && attr(s, "messaging.batch.message_count") >= 0:
			if handler != nil {
				t.Fatalf("two batch handler call spans; the two records should be one batch, one call")
			}
			handler = s
		case s.Name() == "kfn.batch":
			batches[s.SpanContext().SpanID()] = true
		case s.Name() == "process "+b.topic:
			records[attr(s, "messaging.kafka.offset")] = s
		}
	}
	if handler == nil || !batches[handler.Parent().SpanID()] || attr(handler, "messaging.batch.message_count") != 2 {
		t.Fatalf("batch handler call span %v: want one, child of a kfn.batch span, with messaging.batch.message_count 2", handler)
	}
	checkMessagingAttrs(t, handler, map[string]string{
		"messaging.system": "kafka", "messaging.operation.type": "process", "messaging.destination.name": b.topic,
		"messaging.destination.partition.id": "0", "messaging.consumer.group.name": b.fn,
	})
	traced, plain := records[0], records[1]
	if traced == nil || plain == nil {
		t.Fatalf("record spans by offset %v, want offsets 0 and 1", records)
	}
	for off, s := range records {
		checkMessagingAttrs(t, s, map[string]string{
			"messaging.system": "kafka", "messaging.operation.type": "process", "messaging.destination.name": b.topic,
			"messaging.destination.partition.id": "0", "messaging.consumer.group.name": b.fn, "messaging.kafka.offset": fmt.Sprint(off),
		})
	}
	if traced.SpanContext().TraceID().String() != parent[3:35] || traced.Parent().SpanID().String() != parent[36:52] ||
		len(traced.Links()) != 1 || traced.Links()[0].SpanContext.SpanID() != handler.SpanContext().SpanID() {
		t.Errorf("traced record's span: trace %s, parent %s, links %v; want the producer's context, linked to the handler span",
			traced.SpanContext().TraceID(), traced.Parent().SpanID(), traced.Links())
	}
	if plain.Parent().SpanID() != handler.SpanContext().SpanID() || len(plain.Links()) != 0 {
		t.Errorf("plain record's span: parent %s, links %v; want the handler span as parent", plain.Parent().SpanID(), plain.Links())
	}
	events := b.outboxHeaders(t, 2)
	for off, s := range map[int64]sdktrace.ReadOnlySpan{0: traced, 1: plain} {
		sc := s.SpanContext()
		if want := fmt.Sprintf("00-%s-%s-01", sc.TraceID(), sc.SpanID()); events[off]["traceparent"] != want {
			t.Errorf("offset %d: event traceparent %q, want its kfn.record span's %q", off, events[off]["traceparent"], want)
		}
	}
}
