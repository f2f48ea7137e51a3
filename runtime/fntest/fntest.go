// Package fntest tests a kfn Function the way a worker runs it, inside a
// transaction the test owns: each record goes through the function's
// Handler (or its BatchHandler, as a batch of one; a record it rejects is
// dead-lettered as permanent) in a savepoint, its events are checked against the function's
// Emits as the worker checks them, and the test gets back what the worker
// would have done with it (applied, skipped as a duplicate, or
// dead-lettered, with the reason) and the events it emitted. Nothing is
// written to kfn's own tables: a test needs only the function's tables (Setup
// creates them) and a Postgres transaction, which it rolls back at the end.
//
//	tx := … // a transaction on a test database
//	fn := fntest.New(orders.Function())
//	if err := fn.Setup(ctx, tx); err != nil { … }
//	res, err := fn.Apply(ctx, tx, runtime.Record{Topic: "orders", Offset: 0, Value: []byte(`{…}`)})
//	// res[0].Outcome == fntest.Applied, res[0].Events[0].Subject == "orders.accepted"
//
// With KeyOrder ParkKey, a dead-lettered record parks the later records of
// its key on its partition, as the worker does: they are DeadLettered with
// reason key_parked, without a handler call.
//
// What it leaves to the worker: batching (every record runs alone: call a
// BatchHandler directly with a zero BatchEvents to test a whole batch), the
// inbox tables and the fence, the outbox relay, backoff between retries,
// --handler-timeout, --max-record-bytes and dead letter retries (a parked
// key stays parked).
package fntest

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

// Outcome is what the worker does with a record.
type Outcome string

const (
	// Applied: the handler's writes and events commit.
	Applied Outcome = "applied"
	// Duplicate: the record was handled before (same offset, or same event
	// id); the handler is not called.
	Duplicate Outcome = "duplicate"
	// DeadLettered: the handler failed permanently, or on every attempt;
	// its writes are rolled back and the record goes to kfn.dead_letters.
	DeadLettered Outcome = "dead_lettered"
)

// Result is what became of one record.
type Result struct {
	Record  runtime.Record
	Outcome Outcome
	// Reason is the dead letter's reason (permanent, handler_error, panic,
	// timeout, data_error, or key_parked), and Err the handler's last error
	// (for key_parked, the offset it waits behind); both empty unless
	// DeadLettered.
	Reason string
	Err    error
	// Attempts is how many times the handler was called.
	Attempts int
	// Events are the events the record's transaction emitted, as the relay
	// would publish them (Type and Key defaulted); empty unless Applied.
	Events []runtime.Event
}

// Function applies records to one Function.
type Function struct {
	fn runtime.Function
	// RetryAttempts is how often a failing record is tried before it is
	// dead-lettered, as the worker's --retry-attempts. Default 5.
	RetryAttempts int
	handled       map[string]bool
	parked        map[parkedKey]int64 // KeyOrder ParkKey: a key's blocking offset on its partition
}

// parkedKey is a key of a partition.
type parkedKey struct {
	topic     string
	partition int32
	key       string
}

// New returns a Function that applies records to fn.
func New(fn runtime.Function) *Function {
	return &Function{fn: fn, RetryAttempts: settings.DefaultRetryAttempts, handled: map[string]bool{}, parked: map[parkedKey]int64{}}
}

// Setup runs the function's Setup in tx, if it has one.
func (f *Function) Setup(ctx context.Context, tx pgx.Tx) error {
	if f.fn.Setup == nil {
		return nil
	}
	return f.fn.Setup(ctx, tx)
}

// Apply applies recs in order inside tx and returns what became of each.
// A record applied (or dead-lettered) before by this Function is a
// Duplicate, as it is for the worker's inbox. The error is for tx itself
// failing, never for a record.
func (f *Function) Apply(ctx context.Context, tx pgx.Tx, recs ...runtime.Record) ([]Result, error) {
	out := make([]Result, 0, len(recs))
	for _, rec := range recs {
		key := identity(rec)
		if f.handled[key] {
			out = append(out, Result{Record: rec, Outcome: Duplicate})
			continue
		}
		parks := f.fn.KeyOrder == runtime.ParkKey && rec.Key != nil && rec.EventID == ""
		pk := parkedKey{rec.Topic, rec.Partition, string(rec.Key)}
		if blocking, ok := f.parked[pk]; parks && ok && blocking < rec.Offset {
			f.handled[key] = true
			out = append(out, Result{Record: rec, Outcome: DeadLettered, Reason: inbox.ReasonKeyParked, Err: errors.New(inbox.KeyParkedError(blocking))})
			continue
		}
		res, err := f.applyOne(ctx, tx, rec)
		if err != nil {
			return out, err
		}
		f.handled[key] = true
		if parks && res.Outcome == DeadLettered {
			if _, ok := f.parked[pk]; !ok {
				f.parked[pk] = rec.Offset
			}
		}
		out = append(out, res)
	}
	return out, nil
}

// applyOne tries rec up to RetryAttempts times, each attempt in a
// savepoint that a failure rolls back.
func (f *Function) applyOne(ctx context.Context, tx pgx.Tx, rec runtime.Record) (Result, error) {
	res := Result{Record: rec}
	for attempt := 1; ; attempt++ {
		rec.Attempt = attempt
		res.Attempts = attempt
		sp, err := tx.Begin(ctx) // a savepoint
		if err != nil {
			return res, fmt.Errorf("fntest: savepoint: %w", err)
		}
		rows, herr := engine.HandleRecord(ctx, sp, f.fn, rec)
		if herr == nil {
			if err := sp.Commit(ctx); err != nil { // release the savepoint
				return res, fmt.Errorf("fntest: release savepoint: %w", err)
			}
			res.Outcome = Applied
			for _, r := range rows {
				res.Events = append(res.Events, runtime.Event(r.Event))
			}
			return res, nil
		}
		if err := sp.Rollback(ctx); err != nil {
			return res, fmt.Errorf("fntest: roll back to savepoint after %v: %w", herr, err)
		}
		if attempt >= max(1, f.RetryAttempts) || !engine.Retryable(herr) {
			res.Outcome, res.Reason, res.Err = DeadLettered, engine.FailureReason(herr), herr
			return res, nil
		}
	}
}

// identity is what the worker's inbox keys a record by.
func identity(rec runtime.Record) string {
	return outbox.SourceID(rec.Topic, rec.Partition, rec.Offset, rec.EventID, 0)
}
