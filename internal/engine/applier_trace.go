package engine

import (
	"context"
	"strconv"

	"go.opentelemetry.io/otel/attribute"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/kfn-dev/kfn/internal/observe"
	"github.com/kfn-dev/kfn/outbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// The spans of a lane (docs/observability.md, "Traces"). The spans of
// handler calls follow OpenTelemetry's messaging semantic conventions: a
// consumer span named "process <destination>" with the messaging.*
// attributes (recordAttrs); kfn.* attributes only say what the
// conventions have no name for.
//
//   - kfn.batch covers one batch transaction: the fence, the inbox claim,
//     the handler calls, the outbox rows and the commit. A batch holds
//     records of many traces and a span has one parent, so it is the root
//     of a trace of its own.
//   - process <topic or subject> (a handler span) covers one handler call. Its parent is the trace context
//     the record carries (a producer's traceparent, or the relay's span of
//     an event a NATS-triggered function consumes), with a link to its
//     kfn.batch; a record without a valid one gets its kfn.batch as parent.
//     So the trace a record arrives in goes on through its handler, the
//     events it emits (their traceparent is the handler span), the relay
//     and the downstream function's handler. The handler's ctx carries the
//     span, so an author's own spans nest under it.
//
// A BatchHandler's call is one "process <destination>" span, child of the
// kfn.batch, with messaging.batch.message_count, over one "process
// <destination>" span per record (a record span), parented like a
// Handler's span (the record's trace context, linked to the call's span;
// else the call's span); a record's events continue its record span.
const (
	spanBatch  = "kfn.batch"
	tracerName = "github.com/kfn-dev/kfn"
	// opProcess is the messaging.operation.name of a handler span, and
	// with the destination its name.
	opProcess = "process"
)

// processSpan is the name of a handler span over destination (the topic,
// or the subject of a NATS-triggered function's event).
func processSpan(destination string) string { return opProcess + " " + destination }

// Span attributes.
const (
	attrFunction    = attribute.Key("kfn.function")
	attrTopic       = attribute.Key("kfn.topic")
	attrPartition   = attribute.Key("kfn.partition")
	attrFirstOffset = attribute.Key("kfn.first_offset")
	attrLastOffset  = attribute.Key("kfn.last_offset")
	attrOffset      = attribute.Key("kfn.offset")
	attrRecords     = attribute.Key("kfn.records")
	attrEpoch       = attribute.Key("kfn.epoch")
	attrAttempt     = attribute.Key("kfn.attempt")
)

// startBatch starts the kfn.batch span of a transaction over recs. Like
// the other start functions, it returns ctx and a nil span when tracing is
// off (a.tracer nil): then nothing is spent on spans, and a record's
// events carry its own trace context as it came.
func (a *applier) startBatch(ctx context.Context, recs []kfn.Record, attempt int) (context.Context, trace.Span) {
	if a.tracer == nil {
		return ctx, nil
	}
	return a.tracer.Start(ctx, spanBatch, trace.WithNewRoot(), trace.WithAttributes(
		attrFunction.String(a.fn.Name), attrTopic.String(a.part.Topic), attrPartition.Int(int(a.part.Partition)),
		attrFirstOffset.Int64(recs[0].Offset), attrLastOffset.Int64(recs[len(recs)-1].Offset),
		attrRecords.Int(len(recs)), attrEpoch.Int64(a.token), attrAttempt.Int(attempt),
	))
}

// startHandler starts the handler span (process <topic>) of rec's handler call, and
// makes rec's events (emitter) continue it; ctx carries the kfn.batch span.
func (a *applier) startHandler(ctx context.Context, rec kfn.Record, emitter *emitCollector) (context.Context, trace.Span) {
	if a.tracer == nil {
		return ctx, nil
	}
	var span trace.Span
	hctx := emitter.traceIn(rec, func(tc observe.RecordTrace) context.Context {
		batch := trace.SpanContextFromContext(ctx)
		parent := outbox.Propagator.Extract(ctx, tc)
		opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(a.recordAttrs(rec)...)}
		if trace.SpanContextFromContext(parent).IsRemote() && batch.IsValid() {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: batch}))
		}
		var hctx context.Context
		hctx, span = a.tracer.Start(parent, processSpan(rec.Topic), opts...)
		return hctx
	})
	return hctx, span
}

// startBatchHandler starts the handler span (process <topic>) of a BatchHandler's call
// over work, child of the kfn.batch span in ctx, and under it one
// record span per record, whose parent is the record's trace context
// (linked to the handler span) or else the handler span: the record's
// events continue its record span (emitter), so a record's trace goes
// on through a batch handler too. End the record spans (the second result)
// when the call returns.
func (a *applier) startBatchHandler(ctx context.Context, work []kfn.Record, emitter *emitCollector) (context.Context, []trace.Span, trace.Span) {
	if a.tracer == nil {
		return ctx, nil, nil
	}
	kv := append(a.messagingAttrs(a.part.Topic, a.part.Partition),
		semconv.MessagingBatchMessageCount(len(work)),
		attrFirstOffset.Int64(work[0].Offset), attrLastOffset.Int64(work[len(work)-1].Offset), attrRecords.Int(len(work)))
	hctx, span := a.tracer.Start(ctx, processSpan(a.part.Topic), trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(kv...))
	handler := span.SpanContext()
	records := make([]trace.Span, 0, len(work))
	for _, r := range work {
		emitter.traceIn(r, func(tc observe.RecordTrace) context.Context {
			parent := outbox.Propagator.Extract(hctx, tc)
			opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(a.recordAttrs(r)...)}
			if trace.SpanContextFromContext(parent).IsRemote() {
				opts = append(opts, trace.WithLinks(trace.Link{SpanContext: handler}))
			}
			rctx, rspan := a.tracer.Start(parent, processSpan(r.Topic), opts...)
			records = append(records, rspan)
			return rctx
		})
	}
	return hctx, records, span
}

// messagingAttrs are the messaging semantic conventions' attributes of a
// handler span over destination's partition: a Kafka topic's partition
// is messaging.destination.partition.id; a NATS-triggered function's lane
// is kfn's own, kfn.partition. The consumer group is the function.
func (a *applier) messagingAttrs(destination string, partition int32) []attribute.KeyValue {
	kv := []attribute.KeyValue{
		semconv.MessagingOperationTypeProcess, semconv.MessagingOperationName(opProcess),
		semconv.MessagingDestinationName(destination), semconv.MessagingConsumerGroupName(a.fn.Name),
	}
	if a.fn.Subject != "" {
		return append(kv, semconv.MessagingSystemKey.String(outbox.MessagingSystemNATS), attrPartition.Int(int(partition)))
	}
	return append(kv, semconv.MessagingSystemKafka, semconv.MessagingDestinationPartitionID(strconv.Itoa(int(partition))))
}

// recordAttrs are the attributes of a span about one record: its
// position (messaging.kafka.offset in a Kafka partition; kfn.offset in a
// NATS-triggered function's lane), its event id (messaging.message.id)
// when it is an event, and its attempt.
func (a *applier) recordAttrs(rec kfn.Record) []attribute.KeyValue {
	kv := append(a.messagingAttrs(rec.Topic, rec.Partition), attrAttempt.Int(rec.Attempt))
	if a.fn.Subject != "" {
		kv = append(kv, attrOffset.Int64(rec.Offset))
	} else {
		kv = append(kv, semconv.MessagingKafkaOffset(int(rec.Offset)))
	}
	if rec.EventID != "" {
		kv = append(kv, semconv.MessagingMessageID(rec.EventID))
	}
	return kv
}
