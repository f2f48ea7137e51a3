package systemtest_test

import (
	"compress/gzip"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	"google.golang.org/protobuf/proto"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

// TestOneTraceSpansOrdersRelayAndLedger runs the chain with tracing turned
// on the way an operator does it, by OTEL_EXPORTER_OTLP_ENDPOINT, pointed
// at an OTLP/HTTP receiver inside the test. The batch span processor's
// delay is ten minutes, so the spans arrive only because the workers flush
// them when they stop (SIGTERM). For each order it finds one trace holding
// the orders handler span, the relay's publish span and the ledger handler
// span, each the parent of the next: under the orders batch span for an
// order produced without a trace context, under the producer's span for
// one produced with it (whose tracestate and baggage reach the event), and
// a new trace for one with garbage trace headers, which is applied all the
// same.
func TestOneTraceSpansOrdersRelayAndLedger(t *testing.T) {
	recv := startOTLPReceiver(t)
	c := newChain(t, 2)
	js := c.jetStream()
	otelEnv := []string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + recv.url, "OTEL_BSP_SCHEDULE_DELAY=600000"}
	ordersW, ledgerW := c.startOrders(otelEnv...), c.startLedger(otelEnv...)
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
	waitUntil(t, 10*time.Second, "the ledger's handler spans to reach the receiver", func() (bool, string) {
		n := 0
		for i := range 3 {
			if len(recv.matching(func(s span) bool {
				return s.service == "ledger" && s.name == "kfn.handler" && s.attrs["kfn.event_id"] == eventID(i%2, int64(i/2))
			})) > 0 {
				n++
			}
		}
		return n == 3, fmt.Sprintf("%d of 3; %d spans received", n, recv.count())
	})

	// chain checks that the orders handler span of order i, the relay
	// span of its event and the ledger handler span of it are in one trace,
	// each the parent of the next, and returns the orders handler span.
	chain := func(i int) span {
		t.Helper()
		part, off := i%2, int64(i/2)
		id := eventID(part, off)
		ho := recv.must(t, fmt.Sprintf("orders handler span of order %d", i), func(s span) bool {
			return s.service == "orders" && s.name == "kfn.handler" && s.attrs["kfn.topic"] == c.topic &&
				s.attrs["kfn.partition"] == fmt.Sprint(part) && s.attrs["kfn.offset"] == fmt.Sprint(off)
		})
		pub := recv.must(t, fmt.Sprintf("relay publish span of order %d's event", i), func(s span) bool {
			return s.name == "kfn.relay.publish" && s.attrs["messaging.message.id"] == id && s.attrs["kfn.duplicate"] == "false"
		})
		hl := recv.must(t, fmt.Sprintf("ledger handler span of order %d's event", i), func(s span) bool {
			return s.service == "ledger" && s.name == "kfn.handler" && s.attrs["kfn.event_id"] == id
		})
		if pub.traceID != ho.traceID || pub.parentID != ho.spanID {
			t.Errorf("order %d: relay span in trace %s under %s, want trace %s under the orders handler span %s", i, pub.traceID, pub.parentID, ho.traceID, ho.spanID)
		}
		if hl.traceID != ho.traceID || hl.parentID != pub.spanID {
			t.Errorf("order %d: ledger handler span in trace %s under %s, want trace %s under the relay span %s", i, hl.traceID, hl.parentID, ho.traceID, pub.spanID)
		}
		lb := recv.must(t, fmt.Sprintf("ledger batch span linked from order %d's ledger handler span", i), func(s span) bool {
			return s.service == "ledger" && s.name == "kfn.batch" && len(hl.links) == 1 && hl.links[0] == s.traceID+"/"+s.spanID
		})
		if lb.attrs["kfn.function"] != ledger.Name || lb.attrs["kfn.topic"] != orders.AcceptedSubject {
			t.Errorf("ledger batch span attributes %v, want function %s and topic %s", lb.attrs, ledger.Name, orders.AcceptedSubject)
		}
		return ho
	}

	// Order 0 has no trace context: its trace starts at the orders batch.
	ho := chain(0)
	batch := recv.must(t, "orders batch span, parent of order 0's handler span", func(s span) bool {
		return s.name == "kfn.batch" && s.spanID == ho.parentID && s.traceID == ho.traceID
	})
	if batch.parentID != "" || batch.service != "orders" {
		t.Errorf("orders batch span has parent %q and service %q, want a root span of service orders", batch.parentID, batch.service)
	}
	for k, want := range map[string]string{"kfn.function": "orders", "kfn.topic": c.topic, "kfn.partition": "0", "kfn.first_offset": "0", "kfn.attempt": "1"} {
		if batch.attrs[k] != want {
			t.Errorf("orders batch span attribute %s = %q, want %q (all: %v)", k, batch.attrs[k], want, batch.attrs)
		}
	}
	if batch.attrs["kfn.records"] == "" || batch.attrs["kfn.last_offset"] == "" || batch.attrs["kfn.epoch"] == "" || batch.attrs["kfn.epoch"] == "0" {
		t.Errorf("orders batch span lacks records, last offset or epoch: %v", batch.attrs)
	}
	if len(ho.links) != 0 {
		t.Errorf("order 0's handler span has links %v; its batch is its parent", ho.links)
	}

	// Order 1 continues its producer's trace, linked to its batch.
	ho = chain(1)
	if ho.traceID != producerTrace || ho.parentID != producerSpan {
		t.Errorf("order 1's handler span is in trace %s under %s, want the producer's trace %s under %s", ho.traceID, ho.parentID, producerTrace, producerSpan)
	}
	if len(ho.links) != 1 || len(recv.matching(func(s span) bool { return s.name == "kfn.batch" && s.traceID+"/"+s.spanID == ho.links[0] })) != 1 {
		t.Errorf("order 1's handler span links %v, want its orders batch span", ho.links)
	}
	h := accepted[order(1).ID]
	if !strings.HasPrefix(h.Get("traceparent"), "00-"+producerTrace+"-") || h.Get("tracestate") != "vendor=x1" || h.Get("baggage") != "tenant=acme" {
		t.Errorf("order 1's event headers: traceparent %q, tracestate %q, baggage %q; want the producer's trace, vendor=x1 and tenant=acme",
			h.Get("traceparent"), h.Get("tracestate"), h.Get("baggage"))
	}

	// Order 2's garbage trace headers are ignored: a new trace, applied.
	ho = chain(2)
	if ho.traceID == producerTrace {
		t.Errorf("order 2's garbage trace context was followed: trace %s", ho.traceID)
	}
	if h := accepted[order(2).ID]; h.Get("baggage") != "" {
		t.Errorf("order 2's event carries baggage %q from garbage", h.Get("baggage"))
	}
	if n := c.count(`SELECT count(*) FROM orders`); n != 3 {
		t.Errorf("%d orders applied, want 3", n)
	}
	t.Logf("trace of order 0:\n%s", recv.tree(chain(0).traceID))
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

// span is what the test reads of an exported span: ids in hex, attribute
// values as text, links as "trace/span".
type span struct {
	service, name             string
	traceID, spanID, parentID string
	attrs                     map[string]string
	links                     []string
	start, end                uint64
}

// otlpReceiver is an OTLP/HTTP trace receiver: it decodes the protobuf
// ExportTraceServiceRequests POSTed to /v1/traces.
type otlpReceiver struct {
	url   string
	mu    sync.Mutex
	spans []span
}

func startOTLPReceiver(t *testing.T) *otlpReceiver {
	r := &otlpReceiver{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path != "/v1/traces" || req.Method != http.MethodPost {
			http.NotFound(w, req)
			return
		}
		body := io.Reader(req.Body)
		if req.Header.Get("Content-Encoding") == "gzip" {
			gz, err := gzip.NewReader(req.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			body = gz
		}
		data, err := io.ReadAll(body)
		var export coltracepb.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(data, &export)
		}
		if err != nil {
			t.Errorf("OTLP receiver: bad request: %v", err)
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.add(&export)
		resp, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.Write(resp) //nolint:errcheck // the exporter retries
	}))
	t.Cleanup(srv.Close)
	r.url = srv.URL
	return r
}

func (r *otlpReceiver) add(export *coltracepb.ExportTraceServiceRequest) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range export.ResourceSpans {
		service := attrs(rs.GetResource().GetAttributes())["service.name"]
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				sp := span{
					service: service, name: s.Name, attrs: attrs(s.Attributes),
					traceID: hex.EncodeToString(s.TraceId), spanID: hex.EncodeToString(s.SpanId), parentID: hex.EncodeToString(s.ParentSpanId),
					start: s.StartTimeUnixNano, end: s.EndTimeUnixNano,
				}
				for _, l := range s.Links {
					sp.links = append(sp.links, hex.EncodeToString(l.TraceId)+"/"+hex.EncodeToString(l.SpanId))
				}
				r.spans = append(r.spans, sp)
			}
		}
	}
}

func attrs(kvs []*commonpb.KeyValue) map[string]string {
	m := map[string]string{}
	for _, kv := range kvs {
		switch v := kv.Value.GetValue().(type) {
		case *commonpb.AnyValue_StringValue:
			m[kv.Key] = v.StringValue
		case *commonpb.AnyValue_IntValue:
			m[kv.Key] = fmt.Sprint(v.IntValue)
		case *commonpb.AnyValue_BoolValue:
			m[kv.Key] = fmt.Sprint(v.BoolValue)
		default:
			m[kv.Key] = kv.Value.String()
		}
	}
	return m
}

func (r *otlpReceiver) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.spans)
}

// matching returns the spans that match accepts.
func (r *otlpReceiver) matching(match func(span) bool) []span {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []span
	for _, s := range r.spans {
		if match(s) {
			out = append(out, s)
		}
	}
	return out
}

// must returns the one span that match accepts, failing the test when
// there is none or more than one.
func (r *otlpReceiver) must(t *testing.T, what string, match func(span) bool) span {
	t.Helper()
	found := r.matching(match)
	if len(found) != 1 {
		t.Fatalf("%d spans match the %s, want 1 (of %d spans received)", len(found), what, r.count())
	}
	return found[0]
}

// tree renders a trace's spans as an indented tree, children in start
// order; the README's example is one of these.
func (r *otlpReceiver) tree(traceID string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	children := map[string][]span{}
	for _, s := range r.spans {
		if s.traceID == traceID {
			children[s.parentID] = append(children[s.parentID], s)
		}
	}
	var b strings.Builder
	var walk func(parent string, depth int)
	walk = func(parent string, depth int) {
		kids := children[parent]
		sort.Slice(kids, func(i, j int) bool { return kids[i].start < kids[j].start })
		for _, s := range kids {
			keys := make([]string, 0, len(s.attrs))
			for k := range s.attrs {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			var kv []string
			for _, k := range keys {
				kv = append(kv, k+"="+s.attrs[k])
			}
			fmt.Fprintf(&b, "%s%s [%s] %s %s\n", strings.Repeat("  ", depth), s.name, s.service,
				time.Duration(s.end-s.start).Round(10*time.Microsecond), strings.Join(kv, " "))
			if len(s.links) > 0 {
				fmt.Fprintf(&b, "%s  links: %s\n", strings.Repeat("  ", depth), strings.Join(s.links, ", "))
			}
			walk(s.spanID, depth+1)
		}
	}
	walk("", 0)
	return b.String()
}
