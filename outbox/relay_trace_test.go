package outbox

import (
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestRelayPublishSpanContinuesTheStoredTraceContext: with a Tracer, each
// publish is a "send <subject>" span (messaging.operation.type send,
// messaging.system nats), child of the trace context stored
// with the event and ended at its stream ack; the message carries the
// span's context (and the stored baggage), so the consumer continues the
// trace from the relay. An event without a stored context gets a span of
// a new trace.
func TestRelayPublishSpanContinuesTheStoredTraceContext(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	rows := f.newRows([]string{"traced", "plain"}, 1)
	rows[0].Origin.TraceParent, rows[0].Origin.TraceState, rows[0].Origin.Baggage = parent, "vendor=x1", "tenant=acme"
	f.insert(rows)

	spans := tracetest.NewSpanRecorder()
	cfg := f.config()
	cfg.Tracer = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)).Tracer("test")
	f.startRelay(cfg)
	f.waitDelivered(len(rows), 30*time.Second)
	msgs := f.requireExactlyOnceInOrder(rows)

	published := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range spans.Ended() {
		for _, kv := range s.Attributes() {
			if kv.Key == "messaging.message.id" && strings.HasPrefix(s.Name(), "send ") {
				published[kv.Value.AsString()] = s
			}
		}
	}
	for _, m := range msgs {
		id := m.Header.Get("Nats-Msg-Id")
		s, ok := published[id]
		if !ok {
			t.Fatalf("no send span for event %s", id)
		}
		if want := "send " + m.Subject; s.Name() != want {
			t.Errorf("event %s: span %q, want %q", id, s.Name(), want)
		}
		got := map[string]string{}
		for _, kv := range s.Attributes() {
			got[string(kv.Key)] = kv.Value.Emit()
		}
		for k, v := range map[string]string{"messaging.system": "nats", "messaging.operation.type": "send", "messaging.operation.name": "send",
			"messaging.destination.name": m.Subject, "messaging.message.id": id} {
			if got[k] != v {
				t.Errorf("event %s: span attribute %s = %q, want %q (all: %v)", id, k, got[k], v, got)
			}
		}
		sc := s.SpanContext()
		if want := "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-01"; m.Header.Get("traceparent") != want {
			t.Errorf("event %s: message traceparent %q, want the relay span's %q", id, m.Header.Get("traceparent"), want)
		}
		if s.SpanKind() != trace.SpanKindProducer {
			t.Errorf("event %s: span kind %v, want producer", id, s.SpanKind())
		}
		if id != rows[0].EventID {
			if s.Parent().IsValid() || sc.TraceID().String() == parent[3:35] {
				t.Errorf("event %s without a trace context: span parent %v in trace %s, want a new trace", id, s.Parent(), sc.TraceID())
			}
			continue
		}
		if sc.TraceID().String() != parent[3:35] || s.Parent().SpanID().String() != parent[36:52] {
			t.Errorf("event %s: span in trace %s under %s, want the stored context %s", id, sc.TraceID(), s.Parent().SpanID(), parent)
		}
		if m.Header.Get("tracestate") != "vendor=x1" || m.Header.Get("baggage") != "tenant=acme" {
			t.Errorf("event %s: tracestate %q, baggage %q; want vendor=x1 and tenant=acme", id, m.Header.Get("tracestate"), m.Header.Get("baggage"))
		}
	}
}
