package runtime_test

import (
	"context"
	"encoding/json"
	"errors"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// A function's main: configuration comes from flags and KFN_* variables,
// SIGTERM stops it after the in-flight batch. The handler gets a batch of
// records and writes them all with one statement.
func ExampleStart() {
	worker.Start(runtime.Function{
		Name:  "orders",
		Topic: "orders",
		Emits: []string{"orders.accepted"},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (order_id text PRIMARY KEY)`)
			return err
		},
		BatchHandler: func(ctx context.Context, tx pgx.Tx, recs []runtime.Record, out *runtime.BatchEvents) error {
			var ids []string
			for _, rec := range recs {
				var o struct {
					ID string `json:"order_id"`
				}
				if err := json.Unmarshal(rec.Value, &o); err != nil {
					out.Reject(rec, err) // dead-lettered at once, with the reason; the batch goes on
					continue
				}
				ids = append(ids, o.ID)
				out.Emit(rec, runtime.Event{Subject: "orders.accepted", Key: o.ID, Data: rec.Value})
			}
			_, err := tx.Exec(ctx, `INSERT INTO orders (order_id) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING`, ids)
			return err // an error rolls the batch back: kfn retries it record by record to find the culprit
		},
	})
}

// A per-record Handler, for simple cases: one call per record, in the
// batch's transaction. PipelineExecs sends its Execs in one round trip per
// batch (it must then not look at Exec's result).
func ExampleHandler() {
	worker.Start(runtime.Function{
		Name:          "audit",
		Topic:         "payments",
		PipelineExecs: true,
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			if rec.Tombstone() {
				return runtime.Permanent(errors.New("tombstone")) // dead-lettered at once
			}
			_, err := tx.Exec(ctx, `INSERT INTO payment_log (key, body) VALUES ($1, $2)`, rec.Key, rec.Value)
			return err
		},
	})
}

// A NATS-triggered function: it consumes the events another function
// emitted; its inbox key is the event id.
func ExampleFunction_natsTriggered() {
	worker.Start(runtime.Function{
		Name:    "ledger",
		Subject: "orders.accepted",
		Emits:   []string{"payments.captured"},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			_, err := tx.Exec(ctx, `INSERT INTO ledger_entries (event_id, body) VALUES ($1, $2)`, rec.EventID, rec.Value)
			return err
		},
	})
}
