// Package runtime holds the types a kfn function's author writes against: a
// Function (a name, a source and a handler), the Record the handler gets,
// the Events it emits, the errors that dead-letter a record (Permanent),
// and the Config of a worker. Package runtime/worker runs a Function, as a
// process (worker.Start) or inside a program of your own (worker.New);
// package runtime/fntest tests one.
//
// # Writing a function
//
//	var Function = runtime.Function{
//		Name:  "orders",
//		Topic: "orders",                      // or Subject: "orders.accepted", a NATS-triggered function
//		Emits: []string{"orders.accepted"},
//		Setup: func(ctx context.Context, tx pgx.Tx) error {
//			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (…)`)
//			return err
//		},
//		BatchHandler: func(ctx context.Context, tx pgx.Tx, recs []runtime.Record, out *runtime.BatchEvents) error {
//			var ids []string
//			for _, rec := range recs {
//				var o Order
//				if err := json.Unmarshal(rec.Value, &o); err != nil {
//					out.Reject(rec, err) // dead-lettered at once; the rest of the batch goes on
//					continue
//				}
//				ids = append(ids, o.ID)
//				out.Emit(rec, runtime.Event{Subject: "orders.accepted", Data: rec.Value})
//			}
//			_, err := tx.Exec(ctx, `INSERT INTO orders … SELECT unnest($1::text[]) …`, ids)
//			return err // the batch is retried record by record, the culprit dead-lettered
//		},
//	}
//
//	func main() { worker.Start(Function) }
//
// # What kfn promises the handler
//
//   - Exactly once. The handler's writes on tx commit in one Postgres
//     transaction together with the record's inbox row (keyed by its
//     offset, or its event id), the fenced move of the partition's cursor
//     and the events it emitted, or not at all. No crash, failover, zombie
//     worker or replay applies a record twice or loses one; a worker whose
//     lease ran out cannot commit, because the cursor's fencing token is
//     checked in the same transaction.
//   - Order. The records of a partition (or a subject) are applied in order,
//     in batches; events are relayed to NATS JetStream in the order their
//     transactions committed, per key.
//   - Bad input never stalls a partition. A handler error is retried with
//     backoff (--retry-attempts) and then the record is dead-lettered in
//     kfn.dead_letters with its reason; a Permanent error, a panic, a
//     handler that overruns --handler-timeout (abandoned if it ignores its
//     ctx) and a record over --max-record-bytes are dead-lettered at once.
//     Later records go on: all of them by default (Continue), or, with
//     KeyOrder ParkKey, those of other keys, while the later records of the
//     dead-lettered record's key wait behind it, in order.
//
// The handler must do all its work on tx, and nothing a retry would repeat
// outside it (an HTTP call, a message sent): those are what Events are for.
//
// A BatchHandler, writing a batch with one statement, is the fast path: a
// batch then costs kfn two round trips of its own (begin, fence and claim;
// outbox rows and commit) plus the handler's. A per-record Handler (one
// call per record, in the same transaction) suits simple cases; with
// PipelineExecs its Execs go in one round trip per batch.
//
// # Tracing it
//
// With the standard OTEL_* variables set (OTEL_EXPORTER_OTLP_ENDPOINT…),
// the worker exports OpenTelemetry spans over OTLP/HTTP: one per batch
// transaction and one per handler call, whose parent is the W3C trace
// context the record carried. The handler's ctx carries its span (and the
// record's baggage), so spans started from ctx with otel.Tracer nest under
// it, and the events it emits continue the trace downstream. Off by
// default; see docs/observability.md, "Traces".
//
// # Testing it
//
// Package runtime/fntest applies records to a Function inside a test's
// transaction and reports what the worker would do with each (applied,
// duplicate, dead-lettered with its reason) and the events it emitted. A
// handler can also be called directly with NewEvents, or a BatchHandler
// with a zero BatchEvents.
//
// The engine that runs these types lives in internal/engine: it imports
// this package, never the other way round.
package runtime
