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

// TestHandleBatchAppliesABatchInOneGo calls the batch handler directly, as
// any Go function, with a batch as a worker would give it: two revisions
// of one order, an invalid order and another order. The invalid one is
// rejected, the others applied, in order, each revision counted.
func TestHandleBatchAppliesABatchInOneGo(t *testing.T) {
	tx, _ := begin(t)
	ctx := context.Background()
	batch := []runtime.Record{
		record(0, `{"order_id":"ord-9","customer":"acme","amount_cents":5,"currency":"USD"}`),
		record(1, `{"order_id":"ord-9","customer":"acme","amount_cents":7,"currency":"USD"}`),
		record(2, `{"order_id":"ord-bad","customer":"acme","amount_cents":0,"currency":"USD"}`),
		record(3, `{"order_id":"ord-10","customer":"zeta","amount_cents":3,"currency":"EUR"}`),
		record(4, "{\"order_id\":\"ord-11\",\"customer\":\"a\\u0000b\",\"amount_cents\":3,\"currency\":\"EUR\"}"),
	}
	var out runtime.BatchEvents
	if err := orders.HandleBatch(ctx, tx, batch, &out); err != nil {
		t.Fatal(err)
	}
	rejected := out.Rejected()
	if len(rejected) != 2 || rejected[0].Record.Offset != 2 || !strings.Contains(rejected[0].Err.Error(), "amount_cents is 0") ||
		rejected[1].Record.Offset != 4 || !strings.Contains(rejected[1].Err.Error(), "customer holds a NUL character") || !runtime.IsPermanent(rejected[0].Err) {
		t.Fatalf("rejected %+v; want offsets 2 (amount 0) and 4 (NUL), as permanent", rejected)
	}
	var keys []string
	for _, ev := range out.Emitted() {
		keys = append(keys, ev.Key)
	}
	if strings.Join(keys, ",") != "ord-9,ord-9,ord-10" {
		t.Errorf("emitted events keyed %v; want ord-9, ord-9, ord-10", keys)
	}
	rows, err := tx.Query(ctx, `SELECT order_id, amount_cents, revisions FROM orders ORDER BY order_id`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		id              string
		amount, revised int64
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		return x, r.Scan(&x.id, &x.amount, &x.revised)
	})
	if err != nil {
		t.Fatal(err)
	}
	if want := []row{{"ord-10", 3, 1}, {"ord-9", 7, 2}}; len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("orders %+v; want %+v (the later revision wins, both counted)", got, want)
	}
	// A second batch revises ord-9 again: the count goes on from the table.
	if err := orders.HandleBatch(ctx, tx, batch[:1], &runtime.BatchEvents{}); err != nil {
		t.Fatal(err)
	}
	var amount, revisions int64
	if err := tx.QueryRow(ctx, `SELECT amount_cents, revisions FROM orders WHERE order_id = 'ord-9'`).Scan(&amount, &revisions); err != nil {
		t.Fatal(err)
	}
	if amount != 5 || revisions != 3 {
		t.Errorf("ord-9 after another batch: amount %d, revisions %d; want 5 and 3", amount, revisions)
	}
}
