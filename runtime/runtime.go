// Package runtime is what a kfn function's author imports: a Function (a
// name, a source and a handler), the Record the handler gets, the Events it
// emits, and Start, which runs the function as a worker.
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
//	func main() { runtime.Start(Function) }
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
// # Running it
//
// Start reads its settings from flags and environment variables (run the
// binary with -h), connects to Kafka, Postgres and NATS, and runs until
// SIGTERM. Run with the argument migrate (`orders migrate
// --database-url …`), the binary applies kfn's schema migrations and the
// function's Setup instead, and exits: run it once as the role that owns
// the schema, and the workers with --skip-setup under a role that has only
// DML rights (see docs/production/postgres.md, "Three roles"). A function deploys as one container image; kfn dev runs one
// locally. To run several functions in one process, or inside a program of
// your own, use NewWorker.
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
// handler can also be called directly with NewEvents.
//
// The worker's engine lives in internal/engine; the names here are its
// author-facing part.
package runtime

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"

	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/outbox"
)

// Function is one deployable unit: one function = one binary = one image.
// Its fields: Name (the consumer in the inbox tables and the lease group;
// letters, digits, '-' and '_'); Topic, the Kafka topic it consumes, or
// Subject (wildcards allowed) and Stream for a NATS-triggered function;
// Emits, the subjects it emits events on; Handler or BatchHandler; Setup,
// which creates its tables (idempotently) at every start, unless
// --skip-setup, and in the binary's migrate mode; and KeyOrder,
// what a dead-lettered record does to the later records of its key
// (Continue, the default, or ParkKey).
type Function = engine.Function

// KeyOrder is what a dead-lettered record does to the later records of its
// key on its partition: Function.KeyOrder, Continue (the default) or
// ParkKey. It applies to Kafka-triggered functions.
//
// With Continue a poison record never holds anything back, but once it is
// fixed and retried (kfn dlq retry) it is applied after the later records
// of its key: out of order for that key. With ParkKey a key's records are
// applied in offset order, but they wait until someone retries or discards
// the dead letter they are parked behind:
//
//	runtime.Function{Name: "accounts", Topic: "accounts", KeyOrder: runtime.ParkKey, Handler: apply}
//
// A record of account A fails at offset 7 and is dead-lettered; A's records
// at offsets 9 and 12 are dead-lettered with reason key_parked without
// reaching the handler, while other accounts go on. Once the handler is
// fixed, kfn dlq retry of offset 7 applies it and then 9 and 12, in that
// order, before any later record of A; kfn dlq discard of offset 7 would
// apply 9 and 12 without it. If 9 fails then, it parks 12 (and A's later
// records) in turn.
type KeyOrder = engine.KeyOrder

const (
	// Continue (the default): a dead-lettered record does not hold back
	// anything; the later records of its key are applied as they come.
	Continue = engine.Continue
	// ParkKey: a dead-lettered record (any reason) also parks every later
	// record with the same key from that partition, in offset order, until
	// it is retried successfully or discarded; other keys go on. Records
	// with no key are never parked.
	ParkKey = engine.ParkKey
)

// Handler applies one record inside tx. Writes on tx commit together with
// the record's inbox row and the emitted events, or not at all: returning
// an error rolls back everything the handler did.
type Handler = engine.Handler

// BatchHandler applies the fresh records of a batch at once, for bulk
// writes. When it fails, the batch's records are applied one per
// transaction, so that the failing one is found and dead-lettered.
type BatchHandler = engine.BatchHandler

// Record is one Kafka record (Topic, Partition, Offset, Key, Value,
// Headers, Time), or one JetStream event for a NATS-triggered function
// (then Topic is the subject, Offset the stream sequence and EventID the
// event's id). Value is nil for a tombstone (Tombstone); Header looks a
// header up; Attempt is 1 on the first try of the record and grows on each
// retry.
type Record = engine.Record

// Header is one record header: a Key and a Value.
type Header = engine.Header

// Events collects the events a Handler emits for its record: Emit adds one
// to the outbox, in the record's transaction.
type Events = engine.Events

// BatchEvents collects the events a BatchHandler emits: Emit(rec, ev) adds
// one emitted for source record rec, and Reject(rec, err) dead-letters a
// record that cannot be applied without failing the rest of the batch.
type BatchEvents = engine.BatchEvents

// Rejection is a record a BatchHandler rejected with BatchEvents.Reject:
// dead-lettered as permanent in the batch's transaction while the other
// records of the batch commit.
type Rejection = engine.Rejection

// Event is a downstream event: written to the outbox in the record's
// transaction and relayed to NATS JetStream. Only Subject is required; Key
// (the ordering key) defaults to the record's key.
type Event = outbox.Event

// NewEvents returns the Events a handler gets for rec, for calling a
// Handler directly (in a test); Emitted then lists what it emitted.
func NewEvents(rec Record) *Events { return engine.NewEvents(rec) }

// Permanent wraps err so that the record is dead-lettered without retries:
// for a failure no retry can fix, such as a payload that does not decode.
func Permanent(err error) error { return engine.Permanent(err) }

// IsPermanent reports whether err (or an error it wraps) is permanent.
func IsPermanent(err error) bool { return engine.IsPermanent(err) }

// Start runs fn as this process's only function: configuration comes from
// flags and environment variables (run the binary with -h to list them),
// and SIGINT or SIGTERM shut it down cleanly. It does not return: it exits
// 0 after a clean shutdown, 2 on bad configuration and 1 when a service
// cannot be used.
func Start(fn Function) { engine.Start(fn) }

// Main is Start without the exit, for tests and wrappers: it parses args,
// writes errors and logs to stderr, and returns the process's exit code.
func Main(fn Function, args []string, stderr io.Writer) int { return engine.Main(fn, args, stderr) }

// Config is a worker's configuration: the flags and environment variables
// Start reads (see -h), for NewWorker. A zero field takes its default.
type Config = engine.Config

// KafkaSecurity is Config.KafkaSecurity: TLS and SASL for Kafka (plain TCP
// when zero). Bind reads it from --kafka-tls, --kafka-ca, --kafka-cert,
// --kafka-key, --kafka-server-name, --kafka-sasl-mechanism, --kafka-sasl-user,
// KFN_KAFKA_SASL_PASSWORD and --kafka-sasl-password-file.
type KafkaSecurity = engine.KafkaSecurity

// NATSSecurity is Config.NATSSecurity: credentials (--nats-creds,
// --nats-nkey or --nats-token-file) and TLS (--nats-ca, --nats-cert,
// --nats-key) for NATS; zero: what --nats-url says.
type NATSSecurity = engine.NATSSecurity

// Worker runs functions: it owns partitions through leases, reads them and
// applies their records exactly once. Run runs it until ctx ends; Stats
// returns its live counters; HTTPHandler serves /metrics, /healthz and
// /readyz.
type Worker = engine.Worker

// NewWorker validates cfg and fns, connects to Postgres, Kafka and NATS,
// checks the schema version and runs each function's Setup. Every failure
// says which setting or service is at fault.
func NewWorker(ctx context.Context, cfg Config, fns ...Function) (*Worker, error) {
	return engine.NewWorker(ctx, cfg, fns...)
}

// DefaultStream is the JetStream stream outbox events are relayed to.
const DefaultStream = engine.DefaultStream

// DecodeJSON decodes a record's value as one JSON value of type T, strictly:
// unknown fields, trailing data and an empty value are errors. A value that
// does not decode is a Permanent error, as no retry can fix it: returned
// from a handler, it dead-letters the record at once.
func DecodeJSON[T any](value []byte) (T, error) {
	var v T
	if len(bytes.TrimSpace(value)) == 0 {
		return v, Permanent(fmt.Errorf("decode %T JSON: the value is empty", v))
	}
	dec := json.NewDecoder(bytes.NewReader(value))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		return v, Permanent(fmt.Errorf("decode %T JSON: %w", v, err))
	}
	if _, err := dec.Token(); err != io.EOF {
		return v, Permanent(fmt.Errorf("decode %T JSON: data after the JSON value", v))
	}
	return v, nil
}
