package fntest_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/fntest"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// Apply runs each record through the function's handler the way a worker
// would, inside the test's transaction, and says what became of it: a
// record that fails once is retried and applied, one whose failure is
// Permanent is dead-lettered at once, and a record seen before is a
// duplicate. The test rolls the transaction back at the end.
func ExampleFunction_Apply() {
	payments := runtime.Function{
		Name:  "payments",
		Topic: "payments",
		Emits: []string{"payments.captured"},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS captured (payment_id text PRIMARY KEY)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			switch {
			case rec.Tombstone():
				return runtime.Permanent(errors.New("nothing to capture"))
			case string(rec.Key) == "flaky" && rec.Attempt == 1:
				return errors.New("the card network timed out") // retried
			}
			if _, err := tx.Exec(ctx, `INSERT INTO captured VALUES ($1)`, rec.Key); err != nil {
				return err
			}
			out.Emit(runtime.Event{Subject: "payments.captured", Data: rec.Value})
			return nil
		},
	}

	ctx := context.Background()
	pg, err := kfntest.SharedPostgres() // a test would use kfntest.Postgres(t)
	if err != nil {
		fmt.Println(err)
		return
	}
	tx, err := pg.Pool.Begin(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer tx.Rollback(ctx)

	fn := fntest.New(payments)
	if err := fn.Setup(ctx, tx); err != nil {
		fmt.Println(err)
		return
	}
	paid := runtime.Record{Topic: "payments", Offset: 0, Key: []byte("p-1"), Value: []byte(`{"cents": 500}`)}
	res, err := fn.Apply(ctx, tx,
		paid,
		runtime.Record{Topic: "payments", Offset: 1, Key: []byte("flaky"), Value: []byte(`{"cents": 700}`)},
		runtime.Record{Topic: "payments", Offset: 2, Key: []byte("p-2")}, // a tombstone
		paid, // delivered again
	)
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, r := range res {
		fmt.Printf("%s: %s after %d attempts, reason %q, events %d\n", r.Record, r.Outcome, r.Attempts, r.Reason, len(r.Events))
	}
	// Output:
	// payments/0@0: applied after 1 attempts, reason "", events 1
	// payments/0@1: applied after 2 attempts, reason "", events 1
	// payments/0@2: dead_lettered after 1 attempts, reason "permanent", events 0
	// payments/0@0: duplicate after 0 attempts, reason "", events 0
}
