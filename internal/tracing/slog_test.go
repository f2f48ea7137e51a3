package tracing

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// TestLogRecordsInsideASpanCarryItsTraceAndSpanID: a record logged with a
// ctx that carries a span has trace_id and span_id (through a logger's
// With, and WithGroup, where they are in the group like the record's other
// attributes); one logged without has neither.
func TestLogRecordsInsideASpanCarryItsTraceAndSpanID(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(LogHandler(slog.NewJSONHandler(&buf, nil)))
	ctx, span := sdktrace.NewTracerProvider().Tracer("test").Start(context.Background(), "work")
	defer span.End()
	sc := span.SpanContext()

	log.InfoContext(ctx, "inside")
	log.With("function", "orders").WithGroup("g").InfoContext(ctx, "inside, grouped", "k", "v")
	log.Info("outside")
	log.InfoContext(context.Background(), "outside, with a ctx")

	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 4 {
		t.Fatalf("%d log lines, want 4:\n%s", len(lines), buf.String())
	}
	for i, line := range lines {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatal(err)
		}
		inside := i < 2
		if i == 1 {
			rec = rec["g"].(map[string]any) // WithGroup puts the record's attributes in g
		}
		want := map[bool][2]any{true: {sc.TraceID().String(), sc.SpanID().String()}, false: {nil, nil}}[inside]
		if rec[LogTraceID] != want[0] || rec[LogSpanID] != want[1] {
			t.Errorf("line %d: trace_id %v, span_id %v, want %v: %s", i, rec[LogTraceID], rec[LogSpanID], want, line)
		}
	}
}
