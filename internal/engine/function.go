package engine

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kfn-dev/kfn/internal/settings"
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
	// Metrics are the author's own Prometheus collectors (counters,
	// histograms, any prometheus.Collector), served on the worker's
	// /metrics (--metrics-addr) beside kfn's, each series with the worker
	// label added. Their names must not start with kfn_, nor have a worker
	// label; a collector that cannot be registered fails NewWorker (and
	// Start) with the function's name.
	Metrics []prometheus.Collector
}

// KeyOrder is what a dead-lettered record does to the later records of
// its key, on its partition.
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

// Handler applies one record inside tx. Writes on tx commit together with
// the record's inbox row and the emitted events, or not at all: returning an
// error rolls back everything the handler did.
type Handler func(ctx context.Context, tx pgx.Tx, rec Record, out *Events) error

// BatchHandler applies several records inside tx.
type BatchHandler func(ctx context.Context, tx pgx.Tx, recs []Record, out *BatchEvents) error

// Event is a downstream event written to the outbox and relayed to NATS
// JetStream. Only Subject is required; Key defaults to the record's key.
type Event = outbox.Event

// DefaultStream is the JetStream stream outbox events are relayed to.
const DefaultStream = settings.DefaultEventStream

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

func (r Record) String() string {
	if r.EventID != "" {
		return fmt.Sprintf("%s event %s (stream seq %d)", r.Topic, r.EventID, r.Offset)
	}
	return fmt.Sprintf("%s/%d@%d", r.Topic, r.Partition, r.Offset)
}

// source is the lane name a function's records come from: its topic, or
// its subject.
func (f Function) source() string {
	if f.Subject != "" {
		return f.Subject
	}
	return f.Topic
}

// Events collects the events a Handler emits for its record. The zero
// value collects them for Emitted only (a handler called directly).
type Events struct {
	emit    func(rec Record, ev Event) // nil outside a worker
	rec     Record
	emitted []Event
}

// NewEvents returns the Events a handler gets for rec, for calling a
// Handler directly (in a test); Emitted then lists what it emitted.
func NewEvents(rec Record) *Events { return &Events{rec: rec} }

// Emit adds an event to the outbox, in the record's transaction.
func (e *Events) Emit(ev Event) {
	e.emitted = append(e.emitted, ev)
	if e.emit != nil {
		e.emit(e.rec, ev)
	}
}

// Emitted lists the events emitted through e so far, in order.
func (e *Events) Emitted() []Event { return e.emitted }

// BatchEvents collects the events a BatchHandler emits and the records it
// rejects. The zero value collects them for Emitted and Rejected only (a
// batch handler called directly).
type BatchEvents struct {
	emit     func(rec Record, ev Event) // nil outside a worker
	emitted  []Event
	rejected []Rejection
}

// Rejection is a record a BatchHandler rejected, with the reason.
type Rejection struct {
	Record Record
	Err    error
}

// Reject dead-letters rec (reason permanent) instead of applying it,
// without failing the batch: the other records commit, and rec's dead
// letter with them, in the batch's transaction. Reject a record before
// writing anything for it (its writes would commit) and emit nothing for
// it (its events are dropped). It is for records no retry can fix, such as
// a value that does not decode. With KeyOrder ParkKey the batch stops at
// the first rejected record instead: the records before it commit, it is
// dead-lettered alone (parking its key), and the rest goes on.
func (e *BatchEvents) Reject(rec Record, err error) {
	if err == nil {
		err = errors.New("rejected")
	}
	if !IsPermanent(err) {
		err = Permanent(err)
	}
	e.rejected = append(e.rejected, Rejection{Record: rec, Err: err})
}

// Rejected lists the records rejected through e so far, in order.
func (e *BatchEvents) Rejected() []Rejection { return e.rejected }

// Emit adds an event emitted for source record rec to the outbox.
func (e *BatchEvents) Emit(rec Record, ev Event) {
	e.emitted = append(e.emitted, ev)
	if e.emit != nil {
		e.emit(rec, ev)
	}
}

// Emitted lists the events emitted through e so far, in order.
func (e *BatchEvents) Emitted() []Event { return e.emitted }

// PermanentError marks a failure that retrying cannot fix, such as a payload
// that does not decode. The record is dead-lettered at once.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err so the record is dead-lettered without retries.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err (or an error it wraps) is permanent.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

func (f Function) validate() error {
	switch {
	case f.Name == "":
		return errors.New("function: Name is empty")
	case !validName(f.Name):
		return fmt.Errorf("function: Name %q may only contain letters, digits, '-' and '_'", f.Name)
	case f.Topic == "" && f.Subject == "":
		return fmt.Errorf("function %s: set Topic (a Kafka topic) or Subject (a JetStream subject)", f.Name)
	case f.Topic != "" && f.Subject != "":
		return fmt.Errorf("function %s: set only one of Topic and Subject", f.Name)
	case f.Handler == nil && f.BatchHandler == nil:
		return fmt.Errorf("function %s: set Handler or BatchHandler", f.Name)
	case f.Handler != nil && f.BatchHandler != nil:
		return fmt.Errorf("function %s: set only one of Handler and BatchHandler", f.Name)
	case f.PipelineExecs && f.Handler == nil:
		return fmt.Errorf("function %s: PipelineExecs applies to a Handler: a BatchHandler sends its own statements", f.Name)
	case f.KeyOrder != Continue && f.KeyOrder != ParkKey:
		return fmt.Errorf("function %s: KeyOrder %v is neither Continue nor ParkKey", f.Name, f.KeyOrder)
	case f.KeyOrder == ParkKey && f.Subject != "":
		return fmt.Errorf("function %s: KeyOrder ParkKey is supported for Kafka-triggered functions (Topic) only", f.Name)
	}
	for _, s := range f.Emits {
		if err := outbox.CheckSubjectPattern(s); err != nil {
			return fmt.Errorf("function %s: Emits: %w", f.Name, err)
		}
	}
	return nil
}

func validName(s string) bool {
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}
