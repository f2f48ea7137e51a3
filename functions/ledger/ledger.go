// Package ledger is the example NATS-triggered function, the second link of
// the orders chain: it consumes the orders.accepted events the orders
// function emits, writes a balanced double entry for each order into the
// ledger_entries table (debit the customer's receivable account, credit
// revenue) and emits payments.captured, all in the event's transaction. It
// owns the ledger_entries table. Events that are not valid orders are
// dead-lettered.
//
// The table has deliberately no unique key per order: exactly-once is the
// runtime's job (the event inbox), and an event applied twice anywhere in the
// chain shows up as a wrong balance instead of being hidden by a constraint.
package ledger

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime"
)

// Name is the function's name: its consumer in the inbox tables and its
// durable JetStream consumer.
const Name = "ledger"

// CapturedSubject is the subject of the event emitted for each booked order.
const CapturedSubject = "payments.captured"

// RevenueAccount is the account every order's amount is credited to.
const RevenueAccount = "revenue"

// ReceivableAccount is the account a customer's orders are debited to.
func ReceivableAccount(customer string) string { return "receivable:" + customer }

// Sides of a ledger entry.
const (
	Debit  = "debit"
	Credit = "credit"
)

// Captured is the payload of payments.captured.
type Captured struct {
	OrderID     string `json:"order_id"`
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
	// EventID is the orders.accepted event the payment was booked for.
	EventID string `json:"event_id"`
}

// Function returns the deployable function.
func Function() runtime.Function {
	return runtime.Function{
		Name:    Name,
		Subject: orders.AcceptedSubject,
		Emits:   []string{CapturedSubject},
		Handler: Handle,
		Setup:   Setup,
	}
}

// Setup creates the ledger_entries table.
func Setup(ctx context.Context, tx pgx.Tx) error {
	_, err := tx.Exec(ctx, `
CREATE TABLE IF NOT EXISTS ledger_entries (
    id           bigserial   PRIMARY KEY,
    account      text        NOT NULL,
    side         text        NOT NULL CHECK (side IN ('debit', 'credit')),
    amount_cents bigint      NOT NULL CHECK (amount_cents > 0),
    currency     text        NOT NULL,
    order_id     text        NOT NULL,
    event_id     text        NOT NULL, -- the orders.accepted event that booked it
    booked_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS ledger_entries_account ON ledger_entries (account, currency);
CREATE INDEX IF NOT EXISTS ledger_entries_order ON ledger_entries (order_id)`)
	return err
}

// Handle books one orders.accepted event.
func Handle(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
	o, err := runtime.DecodeJSON[orders.Order](rec.Value)
	if err != nil {
		return err
	}
	if err := o.Validate(); err != nil {
		return runtime.Permanent(fmt.Errorf("invalid order: %w", err))
	}
	_, err = tx.Exec(ctx, `
INSERT INTO ledger_entries (account, side, amount_cents, currency, order_id, event_id)
VALUES ($1, 'debit', $3, $4, $5, $6), ($2, 'credit', $3, $4, $5, $6)`,
		ReceivableAccount(o.Customer), RevenueAccount, o.AmountCents, o.Currency, o.ID, rec.EventID)
	if err != nil {
		return fmt.Errorf("book order %s: %w", o.ID, err)
	}
	data, err := json.Marshal(Captured{OrderID: o.ID, Customer: o.Customer, AmountCents: o.AmountCents, Currency: o.Currency, EventID: rec.EventID})
	if err != nil {
		return err
	}
	out.Emit(runtime.Event{Subject: CapturedSubject, Key: o.ID, Data: data})
	return nil
}
