package runtime_test

import (
	"context"
	"encoding/json"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/runtime"
)

// A function's main: configuration comes from flags and KFN_* variables,
// SIGTERM stops it after the in-flight batch.
func ExampleStart() {
	runtime.Start(runtime.Function{
		Name:  "orders",
		Topic: "orders",
		Emits: []string{"orders.accepted"},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (order_id text PRIMARY KEY)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			var o struct {
				ID string `json:"order_id"`
			}
			if err := json.Unmarshal(rec.Value, &o); err != nil {
				return runtime.Permanent(err) // dead-lettered at once, with the reason
			}
			if _, err := tx.Exec(ctx, `INSERT INTO orders (order_id) VALUES ($1)`, o.ID); err != nil {
				return err // retried with backoff, then dead-lettered
			}
			out.Emit(runtime.Event{Subject: "orders.accepted", Key: o.ID, Data: rec.Value})
			return nil
		},
	})
}

// A NATS-triggered function: it consumes the events another function
// emitted; its inbox key is the event id.
func ExampleFunction_natsTriggered() {
	runtime.Start(runtime.Function{
		Name:    "ledger",
		Subject: "orders.accepted",
		Emits:   []string{"payments.captured"},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			_, err := tx.Exec(ctx, `INSERT INTO ledger_entries (event_id, body) VALUES ($1, $2)`, rec.EventID, rec.Value)
			return err
		},
	})
}
