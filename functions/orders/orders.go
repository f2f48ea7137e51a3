// Package orders is the example Kafka-triggered function: it consumes JSON
// orders from the "orders" topic, upserts them into the orders table and
// emits an orders.accepted event, all in the batch's transaction. It is
// batch-native: one statement upserts a whole batch (unnest of arrays).
// Orders that cannot be accepted are rejected, and so dead-lettered with
// the reason, without failing the batch.
package orders

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/runtime"
)

// Topic is the Kafka topic orders arrive on.
const Topic = "orders"

// AcceptedSubject is the subject of the event emitted for each accepted order.
const AcceptedSubject = "orders.accepted"

// Order is the payload of an orders record and of orders.accepted.
type Order struct {
	ID          string `json:"order_id"`
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// Validate says why an order cannot be accepted.
func (o Order) Validate() error {
	var errs []error
	if o.ID == "" {
		errs = append(errs, errors.New("order_id is empty"))
	}
	if o.Customer == "" {
		errs = append(errs, errors.New("customer is empty"))
	}
	if o.AmountCents <= 0 {
		errs = append(errs, fmt.Errorf("amount_cents is %d, must be positive", o.AmountCents))
	}
	if len(o.Currency) != 3 {
		errs = append(errs, fmt.Errorf("currency %q is not a 3-letter code", o.Currency))
	}
	for _, f := range []struct{ name, value string }{{"order_id", o.ID}, {"customer", o.Customer}, {"currency", o.Currency}} {
		if strings.ContainsRune(f.value, 0) {
			errs = append(errs, fmt.Errorf("%s holds a NUL character, which Postgres text cannot store", f.name))
		}
	}
	return errors.Join(errs...)
}

// Function returns the deployable function.
func Function() runtime.Function {
	return runtime.Function{
		Name:         "orders",
		Topic:        Topic,
		Emits:        []string{AcceptedSubject},
		BatchHandler: HandleBatch,
		Setup:        Setup,
	}
}

// Setup creates the orders table.
func Setup(ctx context.Context, tx pgx.Tx) error {
	_, err := tx.Exec(ctx, `
CREATE TABLE IF NOT EXISTS orders (
    order_id     text PRIMARY KEY,
    customer     text   NOT NULL,
    amount_cents bigint NOT NULL,
    currency     text   NOT NULL,
    revisions    integer NOT NULL DEFAULT 1, -- how many records changed this order
    updated_at   timestamptz NOT NULL DEFAULT now()
)`)
	return err
}

// Decode reads an order record: a tombstone, a value that does not decode
// and an invalid order are Permanent errors.
func Decode(rec runtime.Record) (Order, error) {
	if rec.Tombstone() {
		return Order{}, runtime.Permanent(errors.New("tombstone: orders are never deleted"))
	}
	o, err := runtime.DecodeJSON[Order](rec.Value)
	if err != nil {
		return Order{}, err
	}
	if err := o.Validate(); err != nil {
		return Order{}, runtime.Permanent(fmt.Errorf("invalid order: %w", err))
	}
	return o, nil
}

// upsertSQL upserts a batch of orders given as parallel arrays, one
// element per order id (a batch's revisions of one order are folded into
// its last, with their count).
const upsertSQL = `
INSERT INTO orders (order_id, customer, amount_cents, currency, revisions)
SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::int[])
ON CONFLICT (order_id) DO UPDATE
   SET customer = EXCLUDED.customer, amount_cents = EXCLUDED.amount_cents, currency = EXCLUDED.currency,
       revisions = orders.revisions + EXCLUDED.revisions, updated_at = now()`

// HandleBatch accepts a batch of order records in one statement. A record
// that is not a valid order is rejected (dead-lettered as permanent) and
// the others are applied. Records of one order in the batch are applied in
// order: the last one wins, and each counts as a revision.
func HandleBatch(ctx context.Context, tx pgx.Tx, recs []runtime.Record, out *runtime.BatchEvents) error {
	var ids, customers, currencies []string
	var amounts []int64
	var revisions []int32
	at := make(map[string]int, len(recs)) // order id -> its element in the arrays
	for _, rec := range recs {
		o, err := Decode(rec)
		if err != nil {
			out.Reject(rec, err)
			continue
		}
		if i, ok := at[o.ID]; ok {
			customers[i], amounts[i], currencies[i] = o.Customer, o.AmountCents, o.Currency
			revisions[i]++
		} else {
			at[o.ID] = len(ids)
			ids, customers, amounts, currencies = append(ids, o.ID), append(customers, o.Customer), append(amounts, o.AmountCents), append(currencies, o.Currency)
			revisions = append(revisions, 1)
		}
		data, err := json.Marshal(o)
		if err != nil {
			return err
		}
		out.Emit(rec, runtime.Event{Subject: AcceptedSubject, Key: o.ID, Data: data})
	}
	if len(ids) == 0 {
		return nil
	}
	if _, err := tx.Exec(ctx, upsertSQL, ids, customers, amounts, currencies, revisions); err != nil {
		return fmt.Errorf("upsert %d orders: %w", len(ids), err)
	}
	// The worker's log (slog's default); with ctx, the line carries the
	// handler span's trace_id and span_id.
	slog.DebugContext(ctx, "orders upserted", "orders", len(ids), "records", len(recs))
	return nil
}
