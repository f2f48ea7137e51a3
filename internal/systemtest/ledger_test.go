package systemtest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	kfnworker "github.com/kfn-dev/kfn/runtime/worker"
)

// TestLedgerBooksValidOrdersAndDeadLettersTheRest feeds the ledger one valid
// orders.accepted event and four it cannot book. The valid one becomes a
// debit, a credit and a payments.captured event; each of the others is
// dead-lettered at once with its reason, and the lane goes on.
func TestLedgerBooksValidOrdersAndDeadLettersTheRest(t *testing.T) {
	pg := kfntest.Postgres(t)
	srv := kfntest.NATSProcess(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	nc, err := nats.Connect(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js := jetStreamOf(t, nc)
	if _, err := outbox.ExtendStream(ctx, js, runtime.DefaultStream, []string{orders.AcceptedSubject, ledger.CapturedSubject}, outbox.StreamLimits{Duplicates: time.Minute, MaxAge: time.Hour}); err != nil {
		t.Fatal(err)
	}
	valid, _ := json.Marshal(orders.Order{ID: "ord-1", Customer: "acme", AmountCents: 1250, Currency: "EUR"})
	invalid, _ := json.Marshal(orders.Order{ID: "ord-2", Customer: "acme", AmountCents: -5, Currency: "EUR"})
	events := []struct{ id, data, wantErr string }{
		{"ev-valid", string(valid), ""},
		{"ev-garbled", `{"order_id": "ord-3", "amount_cents": `, "decode orders.Order JSON"},
		{"ev-unknown-field", `{"order_id": "ord-4", "customer": "acme", "amount_cents": 1, "currency": "EUR", "coupon": "x"}`, `unknown field "coupon"`},
		{"ev-invalid", string(invalid), "amount_cents is -5, must be positive"},
		{"ev-empty", "", "the value is empty"},
	}
	for _, ev := range events {
		m := nats.NewMsg(orders.AcceptedSubject)
		m.Header.Set("Nats-Msg-Id", ev.id)
		m.Data = []byte(ev.data)
		if _, err := js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}

	w, err := kfnworker.New(ctx, runtime.Config{
		KafkaBrokers: kfntest.Kafka(t).Brokers, DatabaseURL: pg.URL, NATSURL: srv.URL,
		NoRelay: true, RetryAttempts: 3, RetryInitial: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond,
	}, ledger.Function())
	if err != nil {
		t.Fatal(err)
	}
	stop := kfntest.Background(t, "worker", w.Run)
	waitUntil(t, 30*time.Second, "every event handled", func() (bool, string) {
		var n int
		err := pg.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.event_inbox WHERE consumer = $1`, ledger.Name).Scan(&n)
		return err == nil && n == len(events), fmt.Sprintf("%d of %d events in the inbox (%v)", n, len(events), err)
	})
	stop()

	dead, err := inbox.ListDeadLetters(ctx, pg.Pool, ledger.Name, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != len(events)-1 {
		t.Errorf("%d dead letters, want %d: %+v", len(dead), len(events)-1, dead)
	}
	for _, ev := range events[1:] {
		found := false
		for _, d := range dead {
			if strings.Contains(d.Error, ev.wantErr) {
				found = true
				if d.Reason != "permanent" || d.Attempts != 1 {
					t.Errorf("dead letter for %s: reason %q after %d attempts, want permanent after 1", ev.id, d.Reason, d.Attempts)
				}
			}
		}
		if !found {
			t.Errorf("no dead letter says %q (event %s)", ev.wantErr, ev.id)
		}
	}

	rows, err := pg.Pool.Query(ctx, `SELECT account, side, amount_cents, currency, order_id, event_id FROM ledger_entries ORDER BY side DESC`)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var account, side, currency, order, event string
		var amount int64
		if err := rows.Scan(&account, &side, &amount, &currency, &order, &event); err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprintf("%s %s %d %s %s %s", side, account, amount, currency, order, event))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want := []string{"debit receivable:acme 1250 EUR ord-1 ev-valid", "credit revenue 1250 EUR ord-1 ev-valid"}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("ledger entries:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	var subject string
	var key, data []byte
	var outboxRows int
	err = pg.Pool.QueryRow(ctx, `SELECT count(*) OVER (), subject, event_key, data FROM kfn.outbox`).Scan(&outboxRows, &subject, &key, &data)
	if err != nil || outboxRows != 1 {
		t.Fatalf("the outbox holds %d rows (%v), want exactly the payments.captured event", outboxRows, err)
	}
	var captured ledger.Captured
	if err := json.Unmarshal(data, &captured); err != nil {
		t.Fatal(err)
	}
	wantCaptured := ledger.Captured{OrderID: "ord-1", Customer: "acme", AmountCents: 1250, Currency: "EUR", EventID: "ev-valid"}
	if subject != ledger.CapturedSubject || string(key) != "ord-1" || captured != wantCaptured {
		t.Errorf("outbox event %s key %s %+v, want %s key ord-1 %+v", subject, key, captured, ledger.CapturedSubject, wantCaptured)
	}
}
