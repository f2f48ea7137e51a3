// Package ledger is the example NATS-triggered function, the second link of
// the orders chain: it consumes the orders.accepted events the orders
// function emits, writes a balanced double entry for each order into the
// ledger_entries table (debit the customer's receivable account, credit
// revenue) and emits payments.captured, all in the batch's transaction: one
// INSERT books a whole batch (unnest of arrays). It owns the ledger_entries
// table. Events that are not valid orders are rejected (dead-lettered).
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
		Name:         Name,
		Subject:      orders.AcceptedSubject,
		Emits:        []string{CapturedSubject},
		BatchHandler: HandleBatch,
		Setup:        Setup,
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

// bookSQL books a debit (to the receivable account) and a credit (to
// revenue) per order, the orders given as parallel arrays.
const bookSQL = `
INSERT INTO ledger_entries (account, side, amount_cents, currency, order_id, event_id)
SELECT e.account, e.side, o.amount_cents, o.currency, o.order_id, o.event_id
  FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[])
       WITH ORDINALITY AS o(receivable, amount_cents, currency, order_id, event_id, n)
 CROSS JOIN LATERAL (VALUES (o.receivable, 'debit', 1), ($6, 'credit', 2)) AS e(account, side, k)
 ORDER BY o.n, e.k`

// HandleBatch books a batch of orders.accepted events in one statement. An
// event that is not a valid order is rejected (dead-lettered as permanent)
// and the others are booked.
func HandleBatch(ctx context.Context, tx pgx.Tx, recs []runtime.Record, out *runtime.BatchEvents) error {
	var receivables, currencies, ids, events []string
	var amounts []int64
	for _, rec := range recs {
		o, err := orders.Decode(rec)
		if err != nil {
			out.Reject(rec, err)
			continue
		}
		receivables, amounts, currencies = append(receivables, ReceivableAccount(o.Customer)), append(amounts, o.AmountCents), append(currencies, o.Currency)
		ids, events = append(ids, o.ID), append(events, rec.EventID)
		data, err := json.Marshal(Captured{OrderID: o.ID, Customer: o.Customer, AmountCents: o.AmountCents, Currency: o.Currency, EventID: rec.EventID})
		if err != nil {
			return err
		}
		out.Emit(rec, runtime.Event{Subject: CapturedSubject, Key: o.ID, Data: data})
	}
	if len(ids) == 0 {
		return nil
	}
	if _, err := tx.Exec(ctx, bookSQL, receivables, amounts, currencies, ids, events, RevenueAccount); err != nil {
		return fmt.Errorf("book %d orders: %w", len(ids), err)
	}
	return nil
}
