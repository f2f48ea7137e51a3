package systemtest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestOneTraceSpansOrdersRelayAndLedger runs the chain with tracing turned
// on the way an operator does it, by OTEL_EXPORTER_OTLP_ENDPOINT and
// OTEL_EXPORTER_OTLP_PROTOCOL=grpc, pointed at an OTLP/gRPC receiver inside
// the test. The batch span processor's
// delay is ten minutes, so the spans arrive only because the workers flush
// them when they stop (SIGTERM). For each order it finds one trace holding
// the orders handler span, the relay's publish span and the ledger handler
// span, each the parent of the next: under the orders batch span for an
// order produced without a trace context, under the producer's span for
// one produced with it (whose tracestate and baggage reach the event), and
// a new trace for one with garbage trace headers, which is applied all the
// same. The spans follow the messaging semantic conventions: "process
// orders" → "send orders.accepted" → "process orders.accepted". The debug
// line the orders handler logs with its ctx carries the trace_id and
// span_id of its span.
func TestOneTraceSpansOrdersRelayAndLedger(t *testing.T) {
	recv := kfntest.StartOTLPGRPCReceiver(t)
	c := newChain(t, 2)
	js := c.jetStream()
	otelEnv := []string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + recv.URL, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc", "OTEL_BSP_SCHEDULE_DELAY=600000"}
	ordersW, ledgerW := c.startOrders(append(otelEnv, "KFN_LOG_LEVEL=debug")...), c.startLedger(otelEnv...)
	ordersW.waitStarted(t)
	ledgerW.waitStarted(t)

	const (
		producerTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
		producerSpan  = "00f067aa0ba902b7"
	)
	msg := func(i int, headers ...kafka.Header) kafka.Message {
		v, err := json.Marshal(order(i))
		if err != nil {
			t.Fatal(err)
		}
		return kafka.Message{Partition: i % 2, Key: []byte(order(i).ID), Value: v, Headers: headers}
	}
	c.kafka.Produce(t, c.topic,
		msg(0), // partition 0, offset 0: no trace context
		msg(1, kafka.Header{Key: "traceparent", Value: []byte("00-" + producerTrace + "-" + producerSpan + "-01")},
			kafka.Header{Key: "tracestate", Value: []byte("vendor=x1")},
			kafka.Header{Key: "baggage", Value: []byte("tenant=acme")}), // partition 1, offset 0
		msg(2, kafka.Header{Key: "traceparent", Value: []byte("00-\xff\x00" + producerTrace[4:] + "-" + producerSpan + "-01")},
			kafka.Header{Key: "baggage", Value: []byte("=\x00;;")}), // partition 0, offset 1: garbage
	)
	waitUntil(t, 60*time.Second, "the ledger to book the 3 orders", func() (bool, string) {
		n := c.count(`SELECT count(*) FROM kfn.event_inbox WHERE consumer = $1`, ledger.Name)
		return n == 3, fmt.Sprintf("%d of 3 events in the ledger's inbox", n)
	})
	accepted := acceptedHeaders(t, js)
	stopClean(t, ordersW, ledgerW)

	eventID := func(partition int, offset int64) string {
		return outbox.EventID("orders", outbox.KafkaSourceID(c.topic, int32(partition), offset), 0)
	}
	// recordSpan reports whether s is the "process <destination>" span of
	// one record (a Handler's call, or a BatchHandler's record: orders and
	// ledger are batch-native), not of a batch handler's call.
	recordSpan := func(s kfntest.Span) bool {
		return strings.HasPrefix(s.Name, "process ") && s.Attrs["messaging.batch.message_count"] == ""
	}
	// batchOf returns the kfn.batch span s is, or is the call span of.
	batchOf := func(s kfntest.Span) kfntest.Span {
		t.Helper()
		if strings.HasPrefix(s.Name, "process ") {
			s = recv.Must(t, "batch span of a batch handler call", func(b kfntest.Span) bool { return b.SpanID == s.ParentID && b.TraceID == s.TraceID })
		}
		if s.Name != "kfn.batch" {
			t.Fatalf("span %s [%s] is not a kfn.batch span or a batch handler call under one", s.Name, s.Service)
		}
		return s
	}

	waitUntil(t, 10*time.Second, "the ledger's handler spans to reach the receiver", func() (bool, string) {
		n := 0
		for i := range 3 {
			if len(recv.Matching(func(s kfntest.Span) bool {
				return s.Service == "ledger" && recordSpan(s) && s.Attrs["messaging.message.id"] == eventID(i%2, int64(i/2))
			})) > 0 {
				n++
			}
		}
		return n == 3, fmt.Sprintf("%d of 3; %d spans received", n, recv.Count())
	})

	// chain checks that the orders handler span of order i, the relay
	// span of its event and the ledger handler span of it are in one trace,
	// each the parent of the next, and returns the orders handler span.
	chain := func(i int) kfntest.Span {
		t.Helper()
		part, off := i%2, int64(i/2)
		id := eventID(part, off)
		ho := recv.Must(t, fmt.Sprintf("orders handler span of order %d", i), func(s kfntest.Span) bool {
			return s.Service == "orders" && recordSpan(s) && s.Attrs["messaging.destination.name"] == c.topic &&
				s.Attrs["messaging.destination.partition.id"] == fmt.Sprint(part) && s.Attrs["messaging.kafka.offset"] == fmt.Sprint(off)
		})
		pub := recv.Must(t, fmt.Sprintf("relay publish span of order %d's event", i), func(s kfntest.Span) bool {
			return s.Name == "send "+orders.AcceptedSubject && s.Attrs["messaging.message.id"] == id && s.Attrs["kfn.duplicate"] == "false"
		})
		hl := recv.Must(t, fmt.Sprintf("ledger handler span of order %d's event", i), func(s kfntest.Span) bool {
			return s.Service == "ledger" && recordSpan(s) && s.Attrs["messaging.message.id"] == id
		})
		checkAttrs(t, fmt.Sprintf("order %d's orders span", i), ho, map[string]string{
			"name": "process " + c.topic, "kind": "consumer",
			"messaging.system": "kafka", "messaging.operation.type": "process", "messaging.operation.name": "process",
			"messaging.destination.name": c.topic, "messaging.destination.partition.id": fmt.Sprint(part),
			"messaging.kafka.offset": fmt.Sprint(off), "messaging.consumer.group.name": "orders",
		})
		checkAttrs(t, fmt.Sprintf("order %d's relay span", i), pub, map[string]string{
			"name": "send " + orders.AcceptedSubject, "kind": "producer",
			"messaging.system": "nats", "messaging.operation.type": "send", "messaging.operation.name": "send",
			"messaging.destination.name": orders.AcceptedSubject, "messaging.message.id": id,
		})
		checkAttrs(t, fmt.Sprintf("order %d's ledger span", i), hl, map[string]string{
			"name": "process " + orders.AcceptedSubject, "kind": "consumer",
			"messaging.system": "nats", "messaging.operation.type": "process", "messaging.operation.name": "process",
			"messaging.destination.name": orders.AcceptedSubject, "messaging.consumer.group.name": ledger.Name,
			"messaging.message.id": id,
		})
		if pub.TraceID != ho.TraceID || pub.ParentID != ho.SpanID {
			t.Errorf("order %d: relay span in trace %s under %s, want trace %s under the orders handler span %s", i, pub.TraceID, pub.ParentID, ho.TraceID, ho.SpanID)
		}
		if hl.TraceID != ho.TraceID || hl.ParentID != pub.SpanID {
			t.Errorf("order %d: ledger handler span in trace %s under %s, want trace %s under the relay span %s", i, hl.TraceID, hl.ParentID, ho.TraceID, pub.SpanID)
		}
		if len(hl.Links) != 1 {
			t.Fatalf("order %d's ledger span has links %v, want one to its batch (or batch handler call)", i, hl.Links)
		}
		lb := batchOf(recv.Must(t, fmt.Sprintf("span linked from order %d's ledger span", i), func(s kfntest.Span) bool {
			return s.Service == "ledger" && s.TraceID+"/"+s.SpanID == hl.Links[0]
		}))
		if lb.Attrs["kfn.function"] != ledger.Name || lb.Attrs["kfn.topic"] != orders.AcceptedSubject {
			t.Errorf("ledger batch span attributes %v, want function %s and topic %s", lb.Attrs, ledger.Name, orders.AcceptedSubject)
		}
		return ho
	}

	// Order 0 has no trace context: its trace starts at the orders batch.
	ho := chain(0)
	batch := batchOf(recv.Must(t, "parent of order 0's span", func(s kfntest.Span) bool {
		return s.SpanID == ho.ParentID && s.TraceID == ho.TraceID
	}))
	if batch.ParentID != "" || batch.Service != "orders" {
		t.Errorf("orders batch span has parent %q and service %q, want a root span of service orders", batch.ParentID, batch.Service)
	}
	for k, want := range map[string]string{"kfn.function": "orders", "kfn.topic": c.topic, "kfn.partition": "0", "kfn.first_offset": "0", "kfn.attempt": "1"} {
		if batch.Attrs[k] != want {
			t.Errorf("orders batch span attribute %s = %q, want %q (all: %v)", k, batch.Attrs[k], want, batch.Attrs)
		}
	}
	if batch.Attrs["kfn.records"] == "" || batch.Attrs["kfn.last_offset"] == "" || batch.Attrs["kfn.epoch"] == "" || batch.Attrs["kfn.epoch"] == "0" {
		t.Errorf("orders batch span lacks records, last offset or epoch: %v", batch.Attrs)
	}
	if len(ho.Links) != 0 {
		t.Errorf("order 0's handler span has links %v; its batch is its parent", ho.Links)
	}
	// The orders handler's log line of order 0's batch carries the span
	// of the call (the parent of order 0's record span).
	logged := false
	for _, line := range ordersW.logLines(t) {
		if line["msg"] == "orders upserted" && line["trace_id"] == ho.TraceID {
			logged = true
			if line["span_id"] != ho.ParentID {
				t.Errorf("orders handler log line %v: span_id %v, want the batch handler call's span %s", line, line["span_id"], ho.ParentID)
			}
		}
	}
	if !logged {
		t.Errorf("no \"orders upserted\" log line with order 0's trace_id %s; orders log:\n%s", ho.TraceID, ordersW.LogTail(40))
	}

	// Order 1 continues its producer's trace, linked to its batch.
	ho = chain(1)
	if ho.TraceID != producerTrace || ho.ParentID != producerSpan {
		t.Errorf("order 1's handler span is in trace %s under %s, want the producer's trace %s under %s", ho.TraceID, ho.ParentID, producerTrace, producerSpan)
	}
	if len(ho.Links) != 1 || batchOf(recv.Must(t, "span linked from order 1's span", func(s kfntest.Span) bool { return s.TraceID+"/"+s.SpanID == ho.Links[0] })).Service != "orders" {
		t.Errorf("order 1's handler span links %v, want its orders batch span", ho.Links)
	}
	h := accepted[order(1).ID]
	if !strings.HasPrefix(h.Get("traceparent"), "00-"+producerTrace+"-") || h.Get("tracestate") != "vendor=x1" || h.Get("baggage") != "tenant=acme" {
		t.Errorf("order 1's event headers: traceparent %q, tracestate %q, baggage %q; want the producer's trace, vendor=x1 and tenant=acme",
			h.Get("traceparent"), h.Get("tracestate"), h.Get("baggage"))
	}

	// Order 2's garbage trace headers are ignored: a new trace, applied.
	ho = chain(2)
	if ho.TraceID == producerTrace {
		t.Errorf("order 2's garbage trace context was followed: trace %s", ho.TraceID)
	}
	if h := accepted[order(2).ID]; h.Get("baggage") != "" {
		t.Errorf("order 2's event carries baggage %q from garbage", h.Get("baggage"))
	}
	if n := c.count(`SELECT count(*) FROM orders`); n != 3 {
		t.Errorf("%d orders applied, want 3", n)
	}
	t.Logf("trace of order 0:\n%s", recv.Tree(chain(0).TraceID))
}

// logLines reads the worker's JSON log lines.
func (w *worker) logLines(t *testing.T) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(w.LogFile)
	if err != nil {
		t.Fatal(err)
	}
	var out []map[string]any
	for _, l := range strings.Split(string(data), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil {
			out = append(out, m)
		}
	}
	return out
}

// checkAttrs checks span s's name ("name"), kind ("kind") and attributes
// against want.
func checkAttrs(t *testing.T, what string, s kfntest.Span, want map[string]string) {
	t.Helper()
	for k, v := range want {
		got := s.Attrs[k]
		switch k {
		case "name":
			got = s.Name
		case "kind":
			got = s.Kind
		}
		if got != v {
			t.Errorf("%s: %s = %q, want %q (name %q, attributes %v)", what, k, got, v, s.Name, s.Attrs)
		}
	}
}

// acceptedHeaders reads the orders.accepted events of the stream and
// returns their headers by order id (the event key).
func acceptedHeaders(t *testing.T, js jetstream.JetStream) map[string]natsHeader {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := js.Stream(ctx, runtime.DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{orders.AcceptedSubject}})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]natsHeader{}
	batch, err := cons.Fetch(3, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for m := range batch.Messages() {
		out[m.Headers().Get(outbox.HeaderKey)] = natsHeader(m.Headers())
	}
	if len(out) != 3 {
		t.Fatalf("read %d orders.accepted events, want 3 (%v)", len(out), batch.Error())
	}
	return out
}

type natsHeader map[string][]string

func (h natsHeader) Get(k string) string {
	if v := h[k]; len(v) > 0 {
		return v[0]
	}
	return ""
}
