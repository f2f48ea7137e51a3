package orders_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/fntest"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

// begin returns a transaction on a fresh database with the orders table;
// the test rolls it back.
func begin(t *testing.T) (pgx.Tx, *fntest.Function) {
	t.Helper()
	ctx := context.Background()
	tx, err := kfntest.PostgresEmpty(t).Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(ctx) }) //nolint:errcheck
	fn := fntest.New(orders.Function())
	if err := fn.Setup(ctx, tx); err != nil {
		t.Fatal(err)
	}
	return tx, fn
}

func record(offset int64, value string) runtime.Record {
	var v []byte
	if value != "" {
		v = []byte(value)
	}
	return runtime.Record{Topic: orders.Topic, Offset: offset, Key: []byte("ord-1"), Value: v}
}

func TestAcceptedOrderIsStoredAndAnnounced(t *testing.T) {
	tx, fn := begin(t)
	ctx := context.Background()
	res, err := fn.Apply(ctx, tx,
		record(0, `{"order_id":"ord-1","customer":"acme","amount_cents":1250,"currency":"EUR"}`),
		record(1, `{"order_id":"ord-1","customer":"acme","amount_cents":1300,"currency":"EUR"}`), // a revision
		record(1, `{"order_id":"ord-1","customer":"acme","amount_cents":1300,"currency":"EUR"}`), // delivered twice
	)
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Outcome != fntest.Applied || res[1].Outcome != fntest.Applied || res[2].Outcome != fntest.Duplicate {
		t.Fatalf("outcomes %s, %s, %s; want applied, applied, duplicate (%v %v)", res[0].Outcome, res[1].Outcome, res[2].Outcome, res[0].Err, res[1].Err)
	}
	if len(res[1].Events) != 1 {
		t.Fatalf("the revision emitted %d events, want 1", len(res[1].Events))
	}
	ev := res[1].Events[0]
	var announced orders.Order
	if err := json.Unmarshal(ev.Data, &announced); err != nil {
		t.Fatal(err)
	}
	if ev.Subject != orders.AcceptedSubject || string(ev.Key) != "ord-1" || announced.AmountCents != 1300 {
		t.Errorf("event = subject %s, key %s, order %+v; want %s keyed by the order id with the revised amount", ev.Subject, ev.Key, announced, orders.AcceptedSubject)
	}
	var amount, revisions int64
	if err := tx.QueryRow(ctx, `SELECT amount_cents, revisions FROM orders WHERE order_id = 'ord-1'`).Scan(&amount, &revisions); err != nil {
		t.Fatal(err)
	}
	if amount != 1300 || revisions != 2 {
		t.Errorf("stored order: amount %d, revisions %d; want 1300 and 2 (the duplicate is not a revision)", amount, revisions)
	}
}

func TestOrdersThatCannotBeAcceptedAreDeadLettered(t *testing.T) {
	tx, fn := begin(t)
	cases := []struct{ value, want string }{
		{"", "tombstone"},
		{`{"order_id":"ord-1",`, "decode orders.Order JSON"},
		{`{"order_id":"ord-1","customer":"acme","amount_cents":1,"currency":"EUR","coupon":"x"}`, `unknown field "coupon"`},
		{`{"order_id":"ord-1","customer":"acme","amount_cents":-5,"currency":"EUR"}`, "amount_cents is -5, must be positive"},
		{`{"order_id":"ord-1","customer":"acme","amount_cents":5,"currency":"EUR"} {}`, "data after the JSON value"},
	}
	for i, c := range cases {
		res, err := fn.Apply(context.Background(), tx, record(int64(i), c.value))
		if err != nil {
			t.Fatal(err)
		}
		r := res[0]
		if r.Outcome != fntest.DeadLettered || r.Reason != "permanent" || r.Attempts != 1 || r.Err == nil || !strings.Contains(r.Err.Error(), c.want) {
			t.Errorf("value %q: %s (reason %q, %d attempts, err %v); want dead-lettered at once as permanent, saying %q", c.value, r.Outcome, r.Reason, r.Attempts, r.Err, c.want)
		}
	}
	var n int
	if err := tx.QueryRow(context.Background(), `SELECT count(*) FROM orders`).Scan(&n); err != nil || n != 0 {
		t.Errorf("%d orders stored (%v), want none", n, err)
	}
}

// TestHandleCanBeCalledDirectly calls the handler without fntest, as any Go
// function, with the Events a worker would give it.
func TestHandleCanBeCalledDirectly(t *testing.T) {
	tx, _ := begin(t)
	rec := record(0, `{"order_id":"ord-9","customer":"acme","amount_cents":5,"currency":"USD"}`)
	out := runtime.NewEvents(rec)
	if err := orders.Handle(context.Background(), tx, rec, out); err != nil {
		t.Fatal(err)
	}
	if evs := out.Emitted(); len(evs) != 1 || evs[0].Key != "ord-9" {
		t.Errorf("emitted %+v, want one event keyed ord-9", evs)
	}
}
