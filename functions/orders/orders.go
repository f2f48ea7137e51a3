// Package orders is the example Kafka-triggered function: it consumes JSON
// orders from the "orders" topic, upserts them into the orders table and
// emits an orders.accepted event, all in the record's transaction. Orders
// that cannot be accepted are dead-lettered with the reason.
package orders

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

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
	return errors.Join(errs...)
}

// Function returns the deployable function.
func Function() runtime.Function {
	return runtime.Function{
		Name:    "orders",
		Topic:   Topic,
		Emits:   []string{AcceptedSubject},
		Handler: Handle,
		Setup:   Setup,
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

// Handle accepts one order record.
func Handle(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
	if rec.Tombstone() {
		return runtime.Permanent(errors.New("tombstone: orders are never deleted"))
	}
	o, err := runtime.DecodeJSON[Order](rec.Value)
	if err != nil {
		return err
	}
	if err := o.Validate(); err != nil {
		return runtime.Permanent(fmt.Errorf("invalid order: %w", err))
	}
	_, err = tx.Exec(ctx, `
INSERT INTO orders (order_id, customer, amount_cents, currency) VALUES ($1, $2, $3, $4)
ON CONFLICT (order_id) DO UPDATE
   SET customer = EXCLUDED.customer, amount_cents = EXCLUDED.amount_cents, currency = EXCLUDED.currency,
       revisions = orders.revisions + 1, updated_at = now()`,
		o.ID, o.Customer, o.AmountCents, o.Currency)
	if err != nil {
		return fmt.Errorf("upsert order %s: %w", o.ID, err)
	}
	data, err := json.Marshal(o)
	if err != nil {
		return err
	}
	out.Emit(runtime.Event{Subject: AcceptedSubject, Key: o.ID, Data: data})
	return nil
}
