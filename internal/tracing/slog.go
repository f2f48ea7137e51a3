package tracing

import (
	"context"
	"log/slog"

	"go.opentelemetry.io/otel/trace"
)

// The attributes a log record made inside a span carries, the names
// OpenTelemetry's log data model gives them for logs in JSON.
const (
	LogTraceID = "trace_id"
	LogSpanID  = "span_id"
)

// LogHandler wraps h so that a record logged with a ctx that carries a
// valid span (slog's *Context methods, e.g. slog.InfoContext(ctx, …) in a
// handler, whose ctx carries its span) gets the span's trace_id and
// span_id (in the logger's group, if it has one, like the record's other
// attributes). Records without one are passed on as they are.
func LogHandler(h slog.Handler) slog.Handler { return spanLogHandler{h} }

type spanLogHandler struct{ slog.Handler }

func (h spanLogHandler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r = r.Clone()
		r.AddAttrs(slog.String(LogTraceID, sc.TraceID().String()), slog.String(LogSpanID, sc.SpanID().String()))
	}
	return h.Handler.Handle(ctx, r)
}

func (h spanLogHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return spanLogHandler{h.Handler.WithAttrs(attrs)}
}

func (h spanLogHandler) WithGroup(name string) slog.Handler {
	return spanLogHandler{h.Handler.WithGroup(name)}
}
