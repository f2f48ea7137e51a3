package kfntest

import (
	"compress/gzip"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	"google.golang.org/protobuf/proto"
)

// Span is what a test reads of a span an OTLPReceiver received: ids in
// hex (ParentID "" for a root), attribute values as text, links as
// "traceID/spanID", times in Unix nanoseconds.
type Span struct {
	Service, Name             string
	Kind                      string // consumer, producer, internal, …
	TraceID, SpanID, ParentID string
	Attrs                     map[string]string
	Links                     []string
	Start, End                uint64
}

// OTLPReceiver is an OpenTelemetry collector's OTLP/HTTP trace receiver in
// the test process: it decodes the protobuf ExportTraceServiceRequests
// POSTed to URL + "/v1/traces" (gzip or not) and keeps their spans. Point a
// process at it with OTEL_EXPORTER_OTLP_ENDPOINT=URL.
type OTLPReceiver struct {
	URL   string
	mu    sync.Mutex
	spans []Span
}

// StartOTLPReceiver starts a receiver that stops when the test ends. A
// request it cannot decode fails the test.
func StartOTLPReceiver(t testing.TB) *OTLPReceiver {
	r := &OTLPReceiver{}
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
	r.URL = srv.URL
	return r
}

func (r *OTLPReceiver) add(export *coltracepb.ExportTraceServiceRequest) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range export.ResourceSpans {
		service := attrs(rs.GetResource().GetAttributes())["service.name"]
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				sp := Span{
					Service: service, Name: s.Name, Attrs: attrs(s.Attributes),
					Kind:    strings.ToLower(strings.TrimPrefix(s.Kind.String(), "SPAN_KIND_")),
					TraceID: hex.EncodeToString(s.TraceId), SpanID: hex.EncodeToString(s.SpanId), ParentID: hex.EncodeToString(s.ParentSpanId),
					Start: s.StartTimeUnixNano, End: s.EndTimeUnixNano,
				}
				for _, l := range s.Links {
					sp.Links = append(sp.Links, hex.EncodeToString(l.TraceId)+"/"+hex.EncodeToString(l.SpanId))
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

// Count returns how many spans arrived.
func (r *OTLPReceiver) Count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.spans)
}

// Matching returns the spans that match accepts.
func (r *OTLPReceiver) Matching(match func(Span) bool) []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Span
	for _, s := range r.spans {
		if match(s) {
			out = append(out, s)
		}
	}
	return out
}

// Must returns the one span that match accepts, failing the test when
// there is none or more than one.
func (r *OTLPReceiver) Must(t testing.TB, what string, match func(Span) bool) Span {
	t.Helper()
	found := r.Matching(match)
	if len(found) != 1 {
		t.Fatalf("%d spans match the %s, want 1 (of %d spans received)", len(found), what, r.Count())
	}
	return found[0]
}

// Tree renders a trace's spans as an indented tree, children in start
// order: "name [service] duration attributes", then its links.
func (r *OTLPReceiver) Tree(traceID string) string {
	children := map[string][]Span{}
	for _, s := range r.Matching(func(s Span) bool { return s.TraceID == traceID }) {
		children[s.ParentID] = append(children[s.ParentID], s)
	}
	var b strings.Builder
	var walk func(parent string, depth int)
	walk = func(parent string, depth int) {
		kids := children[parent]
		sort.Slice(kids, func(i, j int) bool { return kids[i].Start < kids[j].Start })
		for _, s := range kids {
			keys := make([]string, 0, len(s.Attrs))
			for k := range s.Attrs {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			kv := make([]string, len(keys))
			for i, k := range keys {
				kv[i] = k + "=" + s.Attrs[k]
			}
			indent := strings.Repeat("  ", depth)
			fmt.Fprintf(&b, "%s%s [%s] %s %s\n", indent, s.Name, s.Service, time.Duration(s.End-s.Start).Round(10*time.Microsecond), strings.Join(kv, " "))
			if len(s.Links) > 0 {
				fmt.Fprintf(&b, "%s  links: %s\n", indent, strings.Join(s.Links, ", "))
			}
			walk(s.SpanID, depth+1)
		}
	}
	walk("", 0)
	return b.String()
}
