package runtime_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/fntest"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// The examples run against a database of the package's tests
// (kfntest.SharedPostgres, started by TestMain's kfntest.Main), each in a
// transaction it rolls back, the way a worker's batch transaction would
// hold the handler's writes.
func exampleTx(ctx context.Context) (pgx.Tx, error) {
	pg, err := kfntest.SharedPostgres()
	if err != nil {
		return nil, err
	}
	return pg.Pool.Begin(ctx)
}

// Order is the value of an orders record.
type Order struct {
	ID          string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
}

// orders is a Kafka-triggered function with a batch handler: one INSERT for
// the whole batch, one event per order.
var orders = runtime.Function{
	Name:  "orders",
	Topic: "orders",
	Emits: []string{"orders.accepted"},
	Setup: func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (order_id text PRIMARY KEY, amount_cents bigint NOT NULL)`)
		return err
	},
	BatchHandler: func(ctx context.Context, tx pgx.Tx, recs []runtime.Record, out *runtime.BatchEvents) error {
		var ids []string
		var amounts []int64
		for _, rec := range recs {
			o, err := runtime.DecodeJSON[Order](rec.Value)
			if err != nil {
				out.Reject(rec, err) // dead-lettered at once, with the reason; the batch goes on
				continue
			}
			ids, amounts = append(ids, o.ID), append(amounts, o.AmountCents)
			out.Emit(rec, runtime.Event{Subject: "orders.accepted", Key: o.ID, Data: rec.Value})
		}
		_, err := tx.Exec(ctx, `INSERT INTO orders (order_id, amount_cents)
			SELECT * FROM unnest($1::text[], $2::bigint[]) ON CONFLICT DO NOTHING`, ids, amounts)
		return err // an error rolls the batch back: the worker retries it record by record to find the culprit
	},
}

// A batch handler gets the fresh records of a batch and writes them with
// one statement, in the batch's transaction; the events it emits are
// written to the outbox in the same transaction. Called directly, as here,
// a zero BatchEvents collects what it emitted.
func ExampleBatchHandler() {
	ctx := context.Background()
	tx, err := exampleTx(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer tx.Rollback(ctx)
	if err := orders.Setup(ctx, tx); err != nil {
		fmt.Println(err)
		return
	}

	batch := []runtime.Record{
		{Topic: "orders", Offset: 0, Key: []byte("o-1"), Value: []byte(`{"order_id": "o-1", "amount_cents": 1250}`)},
		{Topic: "orders", Offset: 1, Key: []byte("o-2"), Value: []byte(`{"order_id": "o-2", "amount_cents": 990}`)},
	}
	var out runtime.BatchEvents
	if err := orders.BatchHandler(ctx, tx, batch, &out); err != nil {
		fmt.Println(err)
		return
	}
	var n int
	var total int64
	if err := tx.QueryRow(ctx, `SELECT count(*), sum(amount_cents) FROM orders`).Scan(&n, &total); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("orders: %d, %d cents\n", n, total)
	for _, ev := range out.Emitted() {
		fmt.Println("emitted", ev.Subject, ev.Key)
	}
	// Output:
	// orders: 2, 2240 cents
	// emitted orders.accepted o-1
	// emitted orders.accepted o-2
}

// A record that no retry can fix (here, a value that does not decode) is
// rejected: it is dead-lettered with reason permanent in the batch's
// transaction, and the other records of the batch commit. Reject it before
// writing anything for it, and emit nothing for it.
func ExampleBatchEvents_Reject() {
	ctx := context.Background()
	tx, err := exampleTx(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer tx.Rollback(ctx)
	if err := orders.Setup(ctx, tx); err != nil {
		fmt.Println(err)
		return
	}

	batch := []runtime.Record{
		{Topic: "orders", Offset: 7, Value: []byte(`{"order_id": "o-7", "amount_cents": 100}`)},
		{Topic: "orders", Offset: 8, Value: []byte(`{"order_id": "o-8", "amount": "lots"}`)},
		{Topic: "orders", Offset: 9, Value: nil}, // a tombstone
	}
	var out runtime.BatchEvents
	if err := orders.BatchHandler(ctx, tx, batch, &out); err != nil {
		fmt.Println(err)
		return
	}
	for _, r := range out.Rejected() {
		fmt.Printf("rejected %s: %v (permanent: %t)\n", r.Record, r.Err, runtime.IsPermanent(r.Err))
	}
	fmt.Println("emitted", len(out.Emitted()), "event")
	// Output:
	// rejected orders/0@8: permanent: decode runtime_test.Order JSON: json: unknown field "amount" (permanent: true)
	// rejected orders/0@9: permanent: decode runtime_test.Order JSON: the value is empty (permanent: true)
	// emitted 1 event
}

// A per-record Handler suits simple cases: it is called once per record, in
// the batch's transaction. Called directly, NewEvents collects what it
// emitted; a Permanent error dead-letters the record at once, without
// retries.
func ExampleHandler() {
	audit := runtime.Function{
		Name:  "audit",
		Topic: "payments",
		Emits: []string{"payments.audited"},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS payment_log (key bytea, body bytea NOT NULL)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			if rec.Tombstone() {
				return runtime.Permanent(errors.New("a payment cannot be deleted"))
			}
			if _, err := tx.Exec(ctx, `INSERT INTO payment_log (key, body) VALUES ($1, $2)`, rec.Key, rec.Value); err != nil {
				return err // retried with backoff, then dead-lettered
			}
			out.Emit(runtime.Event{Subject: "payments.audited", Data: rec.Value})
			return nil
		},
	}

	ctx := context.Background()
	tx, err := exampleTx(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer tx.Rollback(ctx)
	if err := audit.Setup(ctx, tx); err != nil {
		fmt.Println(err)
		return
	}
	for _, rec := range []runtime.Record{
		{Topic: "payments", Partition: 2, Offset: 40, Key: []byte("p-1"), Value: []byte(`{"cents": 500}`)},
		{Topic: "payments", Partition: 2, Offset: 41, Key: []byte("p-1")},
	} {
		out := runtime.NewEvents(rec)
		err := audit.Handler(ctx, tx, rec, out)
		fmt.Printf("%s: emitted %d, err %v, permanent %t\n", rec, len(out.Emitted()), err, runtime.IsPermanent(err))
	}
	// Output:
	// payments/2@40: emitted 1, err <nil>, permanent false
	// payments/2@41: emitted 0, err permanent: a payment cannot be deleted, permanent true
}

// A NATS-triggered function consumes the events other functions emitted
// (here, the orders function's orders.accepted) from JetStream. Its inbox
// key is the event id: an event delivered twice (a redelivery, or the
// relay publishing again after a crash) is applied once. Package fntest
// shows what the worker does with each delivery.
func ExampleFunction_natsTriggered() {
	ledger := runtime.Function{
		Name:    "ledger",
		Subject: "orders.accepted", // Stream defaults to DefaultStream, where the relay publishes
		Emits:   []string{"payments.requested"},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS ledger_entries (event_id text PRIMARY KEY, order_id text NOT NULL)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			o, err := runtime.DecodeJSON[Order](rec.Value)
			if err != nil {
				return err // permanent: dead-lettered at once
			}
			if _, err := tx.Exec(ctx, `INSERT INTO ledger_entries (event_id, order_id) VALUES ($1, $2)`, rec.EventID, o.ID); err != nil {
				return err
			}
			out.Emit(runtime.Event{Subject: "payments.requested", Key: o.ID, Data: rec.Value})
			return nil
		},
	}

	ctx := context.Background()
	tx, err := exampleTx(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer tx.Rollback(ctx)
	fn := fntest.New(ledger)
	if err := fn.Setup(ctx, tx); err != nil {
		fmt.Println(err)
		return
	}
	accepted := runtime.Record{Topic: "orders.accepted", Offset: 12, EventID: "ev-12", Value: []byte(`{"order_id": "o-1", "amount_cents": 1250}`)}
	redelivered := accepted
	redelivered.Offset = 13
	res, err := fn.Apply(ctx, tx, accepted, redelivered)
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, r := range res {
		fmt.Println(r.Record, r.Outcome, len(r.Events))
	}
	// Output:
	// orders.accepted event ev-12 (stream seq 12) applied 1
	// orders.accepted event ev-12 (stream seq 13) duplicate 0
}

// DecodeJSON decodes a record's value strictly; what does not decode is a
// Permanent error, which dead-letters the record at once when a handler
// returns it.
func ExampleDecodeJSON() {
	o, err := runtime.DecodeJSON[Order]([]byte(`{"order_id": "o-1", "amount_cents": 1250}`))
	fmt.Println(o.ID, o.AmountCents, err)
	_, err = runtime.DecodeJSON[Order]([]byte(`{"order_id": "o-1"} {}`))
	fmt.Println(err, runtime.IsPermanent(err))
	// Output:
	// o-1 1250 <nil>
	// permanent: decode runtime_test.Order JSON: data after the JSON value true
}
