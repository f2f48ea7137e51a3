package ledger_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/fntest"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

func event(id, data string) runtime.Record {
	return runtime.Record{Topic: orders.AcceptedSubject, EventID: id, Value: []byte(data)}
}

// TestOrderIsBookedOnceAsABalancedEntry: a valid orders.accepted event
// becomes a debit and a credit of its amount and a payments.captured event
// naming it; the same event again (a redelivery) books nothing; an event
// that is not an order is dead-lettered at once.
func TestOrderIsBookedOnceAsABalancedEntry(t *testing.T) {
	ctx := context.Background()
	tx, err := kfntest.PostgresEmpty(t).Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	fn := fntest.New(ledger.Function())
	if err := fn.Setup(ctx, tx); err != nil {
		t.Fatal(err)
	}
	order := `{"order_id":"ord-1","customer":"acme","amount_cents":1250,"currency":"EUR"}`
	res, err := fn.Apply(ctx, tx, event("ev-1", order), event("ev-1", order), event("ev-2", `{"order_id":`))
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Outcome != fntest.Applied || res[1].Outcome != fntest.Duplicate {
		t.Fatalf("outcomes %s, %s (%v); want applied, duplicate", res[0].Outcome, res[1].Outcome, res[0].Err)
	}
	if r := res[2]; r.Outcome != fntest.DeadLettered || r.Reason != "permanent" || !strings.Contains(r.Err.Error(), "decode orders.Order JSON") {
		t.Errorf("garbled event: %s, reason %q, err %v; want dead-lettered as permanent", r.Outcome, r.Reason, r.Err)
	}

	if len(res[0].Events) != 1 || res[0].Events[0].Subject != ledger.CapturedSubject {
		t.Fatalf("events = %+v, want one %s", res[0].Events, ledger.CapturedSubject)
	}
	var captured ledger.Captured
	if err := json.Unmarshal(res[0].Events[0].Data, &captured); err != nil {
		t.Fatal(err)
	}
	if captured != (ledger.Captured{OrderID: "ord-1", Customer: "acme", AmountCents: 1250, Currency: "EUR", EventID: "ev-1"}) {
		t.Errorf("captured = %+v", captured)
	}

	var debit, credit, entries int64
	err = tx.QueryRow(ctx, `
SELECT coalesce(sum(amount_cents) FILTER (WHERE side = 'debit' AND account = $1), 0),
       coalesce(sum(amount_cents) FILTER (WHERE side = 'credit' AND account = $2), 0),
       count(*)
  FROM ledger_entries`, ledger.ReceivableAccount("acme"), ledger.RevenueAccount).Scan(&debit, &credit, &entries)
	if err != nil {
		t.Fatal(err)
	}
	if debit != 1250 || credit != 1250 || entries != 2 {
		t.Errorf("ledger: debit %d, credit %d in %d entries; want 1250, 1250 in 2", debit, credit, entries)
	}
}

// TestHandleBatchBooksABatchInOneGo calls the batch handler directly with
// a batch of two orders and a garbled event: the garbled one is rejected,
// the orders are booked in order, a debit then a credit each.
func TestHandleBatchBooksABatchInOneGo(t *testing.T) {
	ctx := context.Background()
	tx, err := kfntest.PostgresEmpty(t).Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if err := ledger.Setup(ctx, tx); err != nil {
		t.Fatal(err)
	}
	batch := []runtime.Record{
		event("ev-1", `{"order_id":"ord-1","customer":"acme","amount_cents":100,"currency":"EUR"}`),
		event("ev-2", `{"order_id":`),
		event("ev-3", `{"order_id":"ord-2","customer":"zeta","amount_cents":30,"currency":"USD"}`),
	}
	var out runtime.BatchEvents
	if err := ledger.HandleBatch(ctx, tx, batch, &out); err != nil {
		t.Fatal(err)
	}
	if r := out.Rejected(); len(r) != 1 || r[0].Record.EventID != "ev-2" || !runtime.IsPermanent(r[0].Err) {
		t.Fatalf("rejected %+v; want ev-2, permanent", r)
	}
	if evs := out.Emitted(); len(evs) != 2 || evs[0].Key != "ord-1" || evs[1].Key != "ord-2" {
		t.Fatalf("emitted %+v; want ord-1 then ord-2", evs)
	}
	rows, err := tx.Query(ctx, `SELECT account || ' ' || side || ' ' || amount_cents || ' ' || event_id FROM ledger_entries ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"receivable:acme debit 100 ev-1", "revenue credit 100 ev-1", "receivable:zeta debit 30 ev-3", "revenue credit 30 ev-3"}
	if strings.Join(got, "; ") != strings.Join(want, "; ") {
		t.Errorf("entries %q; want %q", got, want)
	}
}
