package outbox

import (
	"context"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// opSend is the messaging.operation.name of the relay's span of one
// publish, from the publish to the stream's ack (or the failure that gets
// the event sent again); the span is named "send <subject>", after
// OpenTelemetry's messaging semantic conventions.
const opSend = "send"

// MessagingSystemNATS is messaging.system of NATS, which the conventions'
// list of well-known values lacks.
const MessagingSystemNATS = "nats"

// startPublish starts the "send <subject>" span of row's message, child
// of the trace context stored with the row (its source's handler span),
// and replaces the message's trace context with the span's. It returns
// nil when the relay records no spans.
func (l *shardLoop) startPublish(row *relayRow, msg *nats.Msg) trace.Span {
	return l.r.startPublish(row, msg, attribute.Int("kfn.shard", l.shard))
}

// startPublish starts the span of row's message (see shardLoop.startPublish)
// with the reader's own attribute (its shard, or the WAL slot).
func (r *Relay) startPublish(row *relayRow, msg *nats.Msg, reader attribute.KeyValue) trace.Span {
	tracer := r.cfg.Tracer
	if tracer == nil {
		return nil
	}
	parent := Propagator.Extract(context.Background(), propagation.MapCarrier(row.Headers))
	ctx, span := tracer.Start(parent, opSend+" "+row.Subject, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(
		semconv.MessagingSystemKey.String(MessagingSystemNATS),
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName(opSend),
		semconv.MessagingDestinationName(row.Subject),
		semconv.MessagingMessageID(row.EventID),
		attribute.String("kfn.stream", r.cfg.Stream),
		reader,
	))
	Propagator.Inject(ctx, natsHeaderCarrier(msg.Header))
	return span
}

// endPublish ends a publish span (nil: none) with the publish's outcome.
func endPublish(span trace.Span, duplicate bool, err error) {
	if span == nil {
		return
	}
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
	}
	span.SetAttributes(attribute.Bool("kfn.duplicate", duplicate))
	span.End()
}

// natsHeaderCarrier writes trace headers on a NATS message under their
// exact (lowercase) names; nats.Header's own methods keep names as given
// too, but the carrier must replace every value a name had.
type natsHeaderCarrier nats.Header

func (c natsHeaderCarrier) Get(key string) string { return nats.Header(c).Get(key) }
func (c natsHeaderCarrier) Set(key, value string) { c[key] = []string{value} }
func (c natsHeaderCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}
