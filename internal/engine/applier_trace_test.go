package engine

import (
	"context"
	"syscall"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/observe"
	"github.com/kfn-dev/kfn/internal/settings"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// BenchmarkRecordTracing measures what tracing costs a record in a lane's
// path (the parts applier.runHandlers runs per record and per batch), in
// batches of settings.DefaultBatchSize records that each emit one event: "off" is
// the default (no tracer: no span, a record's trace context copied to its
// events as it came), "on" an SDK provider that records every span and
// exports it in batches. Each runs on records without and with a
// traceparent. It reports CPU time per record, which holds on a busy
// machine better than the clock; docs/observability.md compares "off" with the same
// loop on the commit before tracing.
func BenchmarkRecordTracing(b *testing.B) {
	const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	providers := []struct {
		name string
		tp   trace.TracerProvider
	}{
		{"off", nil},
		{"on", sdktrace.NewTracerProvider(sdktrace.WithBatcher(tracetest.NewNoopExporter()))},
	}
	for _, p := range providers {
		for _, withParent := range []bool{false, true} {
			name := p.name + "/no-context"
			if withParent {
				name = p.name + "/traceparent"
			}
			b.Run(name, func(b *testing.B) {
				fn := kfn.Function{Name: "bench", Topic: "orders", Emits: []string{"orders.accepted"}}
				a := &applier{fn: fn, part: inbox.Partition{Consumer: "bench", Topic: "orders"}, token: 7}
				if p.tp != nil {
					a.tracer = p.tp.Tracer(tracerName)
				}
				recs := make([]kfn.Record, settings.DefaultBatchSize)
				for i := range recs {
					recs[i] = kfn.Record{Topic: "orders", Offset: int64(i), Key: []byte("ord-1"), Value: []byte(`{}`), Attempt: 1}
					if withParent {
						recs[i].Headers = []kfn.Header{{Key: "traceparent", Value: []byte(parent)}}
					}
				}
				ev := kfn.Event{Subject: "orders.accepted", Data: []byte(`{}`)}
				b.ReportAllocs()
				n := 0
				cpu0 := cpuTime(b)
				for b.Loop() {
					em := newEmitCollector(fn, 0)
					ctx, batch := a.startBatch(context.Background(), recs, 1)
					for _, r := range recs {
						_, span := a.startHandler(ctx, r, em)
						em.emit(r, ev)
						observe.EndSpan(span, nil)
					}
					observe.EndSpan(batch, nil)
					n += len(recs)
				}
				b.ReportMetric(float64((cpuTime(b)-cpu0).Nanoseconds())/float64(n), "cpu-ns/record")
			})
		}
	}
}

// cpuTime is the CPU time (user and system) of the process so far.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
