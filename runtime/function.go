package runtime

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kfn-dev/kfn/outbox"
)

// Function is one deployable unit: one function = one binary = one image.
type Function struct {
	// Name identifies the function. It is the consumer in the inbox and
	// cursor tables, the Kafka consumer group that lag tools see, and the
	// lease group. Letters, digits, '-' and '_'.
	Name string
	// Topic is the Kafka topic the function consumes. Exactly one of Topic
	// and Subject is set.
	Topic string
	// Subject makes a NATS-triggered function: it consumes the events
	// published on Subject (wildcards allowed) in JetStream stream Stream,
	// through a durable consumer named after the function. Its inbox key is
	// the event id, and it acks an event only after its transaction commits.
	Subject string
	// Stream is the JetStream stream holding Subject; default DefaultStream,
	// the stream the outbox relay publishes to.
	Stream string
	// Emits lists the subjects the function emits events on (wildcards
	// allowed, e.g. "orders.>"). The relay makes the event stream capture
	// them; emitting on any other subject fails the record permanently.
	Emits []string
	// Handler applies one record. Exactly one of Handler and BatchHandler is set.
	Handler Handler
	// BatchHandler applies the fresh records of a batch at once, for bulk
	// writes. When it fails, the records are retried one at a time so the
	// failing one can be found and dead-lettered.
	BatchHandler BatchHandler
	// PipelineExecs makes the Exec calls of a Handler (not a BatchHandler)
	// cheap: each is queued instead of sent, and the queue goes to Postgres
	// in one round trip before the handler's next Query, QueryRow,
	// CopyFrom, SendBatch or savepoint (so reads see every earlier write)
	// and after the batch's last record. Exec then returns an empty command
	// tag and no error: a failing statement fails the record that queued
	// it, later. Set it only for a handler that does not look at Exec's
	// result or error.
	PipelineExecs bool
	// Setup creates the function's business tables. It runs in a transaction
	// at every start of a worker (unless --skip-setup) and in the binary's
	// migrate mode, so it must be idempotent (CREATE TABLE IF NOT EXISTS …).
	Setup func(ctx context.Context, tx pgx.Tx) error
	// KeyOrder says what a dead-lettered record does to the later records
	// of its key (Kafka-triggered functions only). Continue, the default:
	// nothing; they are applied, possibly before the dead-lettered record
	// is fixed and retried. ParkKey: they wait behind it, so a key's records
	// are applied in offset order, at the cost of waiting until someone
	// retries or discards the dead letter (kfn dlq retry, kfn dlq discard).
	KeyOrder KeyOrder
	// KeyConcurrency is how many key-lanes each partition (or subject
	// lane) of the function runs: 1, the default, applies a partition's
	// records one batch transaction after the other, in offset order. With
	// K > 1 the records are split over K key-lanes by a hash of their key
	// (records with no key all go to key-lane 0), and the key-lanes commit
	// side by side: a slow handler's throughput on one partition grows up to
	// K times. Records of one key keep their offset order, and every record
	// is still applied exactly once; records of different keys may commit
	// out of offset order. Each key-lane needs a Postgres connection while
	// it commits. --key-concurrency (KFN_KEY_CONCURRENCY), when set, wins.
	// See docs/scaling.md.
	KeyConcurrency int
	// Metrics are the author's own Prometheus collectors (counters,
	// histograms, any prometheus.Collector), served on the worker's
	// /metrics (--metrics-addr) beside kfn's, each series with the worker
	// label added. Their names must not start with kfn_, nor have a worker
	// label; a collector that cannot be registered fails worker.New (and
	// worker.Start) with the function's name.
	Metrics []prometheus.Collector
}

// Handler applies one record inside tx. Writes on tx commit together with
// the record's inbox row and the emitted events, or not at all: returning
// an error rolls back everything the handler did.
type Handler func(ctx context.Context, tx pgx.Tx, rec Record, out *Events) error

// BatchHandler applies the fresh records of a batch at once, inside tx,
// for bulk writes. When it fails, the batch's records are applied one per
// transaction, so that the failing one is found and dead-lettered; a
// record it cannot apply at all it rejects with BatchEvents.Reject.
type BatchHandler func(ctx context.Context, tx pgx.Tx, recs []Record, out *BatchEvents) error

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
type KeyOrder int

const (
	// Continue keeps a dead-lettered record from holding anything back: the
	// later records of its key are applied as they come. A poison record
	// never stalls its key, but once it is fixed and retried it is applied
	// after them: out of order for that key.
	Continue KeyOrder = iota
	// ParkKey keeps per-key order: a dead-lettered record (for any reason:
	// a handler error after its retries, a Permanent error, a panic, a
	// timeout, a data error, an oversized record) also parks every later
	// record with the same key from that partition, in offset order, while
	// other keys go on. Each of those is dead-lettered with reason
	// key_parked without reaching the handler. When the blocking dead
	// letter is retried successfully (kfn dlq retry) or discarded (kfn dlq
	// discard, or purged), the key is released and its parked records are
	// applied in offset order, before any later record of the key; one that
	// fails then blocks the key in turn. Records with no key are never
	// parked.
	ParkKey
)

func (o KeyOrder) String() string {
	switch o {
	case Continue:
		return "Continue"
	case ParkKey:
		return "ParkKey"
	default:
		return fmt.Sprintf("KeyOrder(%d)", int(o))
	}
}

// Record is one Kafka record, or one JetStream event for a NATS-triggered
// function (then Topic is the subject, Partition is 0, Offset is the stream
// sequence and EventID is set).
//
// A null key, value or header value is nil; an empty one is an empty,
// non-nil slice.
type Record struct {
	Topic     string
	Partition int32
	Offset    int64
	EventID   string // the event id of a JetStream event; empty for Kafka records
	Key       []byte
	Value     []byte // nil for a tombstone
	Headers   []Header
	Time      time.Time
	// Attempt is 1 on the first try and grows on each retry of this record.
	Attempt int
}

// Header is one record header.
type Header struct {
	Key   string
	Value []byte
}

// Tombstone reports whether the record has a null value (a delete marker on
// compacted topics).
func (r Record) Tombstone() bool { return r.Value == nil }

// Header returns the value of the first header named key.
func (r Record) Header(key string) ([]byte, bool) {
	for _, h := range r.Headers {
		if h.Key == key {
			return h.Value, true
		}
	}
	return nil, false
}

// String names the record: topic/partition@offset, or the subject and
// event id of a JetStream event.
func (r Record) String() string {
	if r.EventID != "" {
		return fmt.Sprintf("%s event %s (stream seq %d)", r.Topic, r.EventID, r.Offset)
	}
	return fmt.Sprintf("%s/%d@%d", r.Topic, r.Partition, r.Offset)
}

// Event is a downstream event: written to the outbox in the record's
// transaction and relayed to NATS JetStream (DefaultStream) as a message
// whose Nats-Msg-Id is the event's id, derived from the function, the
// source record and the emit index. Only Subject is required.
type Event struct {
	// Subject is the NATS subject the event is published on, e.g.
	// "orders.accepted": one of the function's Emits.
	Subject string
	// Type is the CloudEvents type; it defaults to Subject.
	Type string
	// Key orders events: events with one key reach the stream in emit order.
	// It defaults to the source record's key. It may hold any bytes (a Go
	// string does); the outbox stores it as bytea. On the message it is the
	// kfn-key header when it is a valid header value, else kfn-key-b64.
	Key string
	// Data is the payload.
	Data []byte
	// Headers are extra message headers. Names and values must be valid
	// UTF-8 without NUL bytes (emitting others fails the record), and the
	// relay drops those NATS cannot carry.
	Headers map[string]string
}

// DefaultStream is the JetStream stream outbox events are relayed to, and
// the stream a NATS-triggered function reads when its Stream is empty.
const DefaultStream = outbox.DefaultStream
