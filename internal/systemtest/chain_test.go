package systemtest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestOrderChainIsExactlyOnceWhileWorkersOfBothStagesAreKilled runs the
// production chain with real processes: Kafka orders topic → 2 orders
// workers → outbox → relay (inside every worker, on leased shards) →
// JetStream → 2 ledger workers → ledger_entries and payments.captured. While
// orders keep coming, it SIGKILLs workers of both stages (the ledger's lane
// owner each time) and starts replacements. When everything has drained,
// every order must be applied once by each stage: a duplicate anywhere
// shows up as a second orders revision or as a wrong ledger balance, a loss
// as a missing row or event.
func TestOrderChainIsExactlyOnceWhileWorkersOfBothStagesAreKilled(t *testing.T) {
	const (
		partitions = 6
		total      = 2000
		perTick    = 20
		tick       = 100 * time.Millisecond
	)
	c := newChain(t, partitions)
	js := c.jetStream()

	ordersW := []*worker{c.startOrders(), c.startOrders()}
	ledgerW := []*worker{c.startLedger(), c.startLedger()}

	// The fault schedule, in ticks of production: kill a worker of one
	// stage, start its replacement a second later.
	type fault struct {
		at    int // tick
		stage string
	}
	faults := []fault{{15, "orders"}, {30, "ledger"}, {45, "orders"}, {60, "ledger"}, {75, "both"}, {90, "ledger"}}
	type restart struct {
		at    int
		stage string
	}
	var restarts []restart
	killed := map[string]int{}
	ledgerAtKill := []int64{}

	kill := func(stage string, ws []*worker) []*worker {
		t.Helper()
		victim := 0
		if stage == "ledger" {
			// The ledger has one active lane: kill its owner, not the standby.
			owner := c.laneOwner()
			for i, w := range ws {
				if w.id == owner {
					victim = i
				}
			}
		}
		w := ws[victim]
		w.Kill()
		t.Logf("SIGKILL %s (%s stage)", w.id, stage)
		killed[stage]++
		return slices.Delete(ws, victim, victim+1)
	}

	restartStage := func(stage string) {
		t.Helper()
		if stage == "orders" || stage == "both" {
			ordersW = append(ordersW, c.startOrders())
		}
		if stage == "ledger" || stage == "both" {
			for len(ledgerW) < 2 {
				ledgerW = append(ledgerW, c.startLedger())
			}
		}
	}

	var produced []orders.Order
	start := time.Now()
	for i := 0; len(produced) < total; i++ {
		if wait := time.Until(start.Add(time.Duration(i) * tick)); wait > 0 {
			time.Sleep(wait)
		}
		batch := make([]orders.Order, perTick)
		for j := range batch {
			batch[j] = order(len(produced) + j)
		}
		c.produce(batch, len(produced))
		produced = append(produced, batch...)

		for _, f := range faults {
			if f.at != i {
				continue
			}
			ledgerAtKill = append(ledgerAtKill, c.tableCount("ledger_entries"))
			switch f.stage {
			case "orders":
				ordersW = kill("orders", ordersW)
			case "ledger":
				ledgerW = kill("ledger", ledgerW)
			case "both":
				ordersW = kill("orders", ordersW)
				ledgerW = kill("ledger", ledgerW)
				ledgerW = kill("ledger", ledgerW) // the whole ledger stage is down
			}
			restarts = append(restarts, restart{at: i + 10, stage: f.stage})
		}
		for _, r := range restarts {
			if r.at == i {
				restartStage(r.stage)
			}
		}
		requireAlive(t, append(slices.Clone(ordersW), ledgerW...)...)
	}
	for _, r := range restarts {
		if r.at >= total/perTick { // due after the last tick
			restartStage(r.stage)
		}
	}
	t.Logf("produced %d orders in %s; killed %d orders and %d ledger workers", len(produced), time.Since(start).Round(time.Millisecond), killed["orders"], killed["ledger"])

	drainStart := time.Now()
	waitUntil(t, 60*time.Second, "the chain to drain", func() (bool, string) {
		ordersRows, entries, outboxRows := c.tableCount("orders"), c.tableCount("ledger_entries"), c.count(`SELECT count(*) FROM kfn.outbox`)
		c.requireEntriesAtMost(entries, 2*total)
		idle, consumer := consumerIdle(js)
		if ordersRows != total || entries != 2*total || outboxRows != 0 || !idle {
			return false, fmt.Sprintf("orders %d/%d, ledger entries %d/%d, outbox %d rows, %s", ordersRows, total, entries, 2*total, outboxRows, consumer)
		}
		return true, ""
	})
	t.Logf("drained %s after production stopped", time.Since(drainStart).Round(time.Millisecond))
	if last := ledgerAtKill[len(ledgerAtKill)-1]; last >= 2*total {
		t.Fatalf("the last kill came after the ledger had booked everything (%d entries): it tested nothing", last)
	}
	requireAlive(t, append(slices.Clone(ordersW), ledgerW...)...)
	stopClean(t, append(ordersW, ledgerW...)...)

	c.requireOrdersOnce(produced)
	c.requireLedgerBalances(produced)
	c.requireNoDeadLetters()
	if n := c.count(`SELECT count(*) FROM kfn.outbox`); n != 0 {
		t.Errorf("kfn.outbox holds %d rows after the drain, want 0", n)
	}
	requireEventsOnce(t, js, orders.AcceptedSubject, produced)
	requireEventsOnce(t, js, ledger.CapturedSubject, produced)
}

// laneOwner is the worker that owns the ledger's subject lane now.
func (c *chain) laneOwner() string {
	c.t.Helper()
	var owner string
	err := c.ledgerPG.Pool.QueryRow(context.Background(),
		`SELECT owner FROM kfn.cursors WHERE consumer = $1 AND topic = $2`, ledger.Name, orders.AcceptedSubject).Scan(&owner)
	if err != nil {
		return "" // not claimed yet
	}
	return owner
}

// requireOrdersOnce checks the orders stage: one row per produced order,
// changed by exactly one record, with the produced amount.
func (c *chain) requireOrdersOnce(produced []orders.Order) {
	c.t.Helper()
	ctx := context.Background()
	rows, err := c.pg.Pool.Query(ctx, `SELECT order_id, customer, amount_cents, currency, revisions FROM orders`)
	if err != nil {
		c.t.Fatal(err)
	}
	defer rows.Close()
	want := map[string]orders.Order{}
	for _, o := range produced {
		want[o.ID] = o
	}
	seen := 0
	for rows.Next() {
		var o orders.Order
		var revisions int
		if err := rows.Scan(&o.ID, &o.Customer, &o.AmountCents, &o.Currency, &revisions); err != nil {
			c.t.Fatal(err)
		}
		seen++
		if w, ok := want[o.ID]; !ok || w != o || revisions != 1 {
			c.t.Errorf("orders row %+v with %d revisions; want %+v with 1 revision (produced: %v)", o, revisions, w, ok)
		}
	}
	if err := rows.Err(); err != nil {
		c.t.Fatal(err)
	}
	if seen != len(produced) {
		c.t.Errorf("orders has %d rows, want one per produced order (%d)", seen, len(produced))
	}
}

// requireLedgerBalances checks the ledger stage: exactly a debit and a
// credit per order, revenue equal to what was ordered, and every
// customer's receivable balance equal to that customer's orders.
func (c *chain) requireLedgerBalances(produced []orders.Order) {
	c.t.Helper()
	ctx := context.Background()
	type accountCurrency struct{ account, currency string }
	want := map[accountCurrency]int64{}
	for _, o := range produced {
		want[accountCurrency{ledger.ReceivableAccount(o.Customer), o.Currency}] += o.AmountCents
		want[accountCurrency{ledger.RevenueAccount, o.Currency}] -= o.AmountCents
	}
	rows, err := c.ledgerPG.Pool.Query(ctx, `
SELECT account, currency, sum(CASE side WHEN 'debit' THEN amount_cents ELSE -amount_cents END)::bigint
  FROM ledger_entries GROUP BY account, currency`)
	if err != nil {
		c.t.Fatal(err)
	}
	defer rows.Close()
	got := map[accountCurrency]int64{}
	for rows.Next() {
		var k accountCurrency
		var balance int64
		if err := rows.Scan(&k.account, &k.currency, &balance); err != nil {
			c.t.Fatal(err)
		}
		got[k] = balance
	}
	if err := rows.Err(); err != nil {
		c.t.Fatal(err)
	}
	for k, w := range want {
		if got[k] != w {
			c.t.Errorf("balance of %s in %s = %d cents, want %d (debits positive)", k.account, k.currency, got[k], w)
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			c.t.Errorf("unexpected account %s in %s with balance %d", k.account, k.currency, g)
		}
	}

	var revenue, orderedSum int64
	if err := c.ledgerPG.Pool.QueryRow(ctx, `SELECT coalesce(sum(amount_cents), 0)::bigint FROM ledger_entries WHERE account = $1 AND side = 'credit'`, ledger.RevenueAccount).Scan(&revenue); err != nil {
		c.t.Fatal(err)
	}
	for _, o := range produced {
		orderedSum += o.AmountCents
	}
	if revenue != orderedSum {
		c.t.Errorf("revenue credits total %d cents, want the sum of the produced orders, %d", revenue, orderedSum)
	}

	var badOrders int64
	var example string
	err = c.ledgerPG.Pool.QueryRow(ctx, `
SELECT count(*), coalesce(min(order_id), '') FROM (
  SELECT order_id FROM ledger_entries GROUP BY order_id
  HAVING count(*) != 2 OR count(*) FILTER (WHERE side = 'debit') != 1 OR count(DISTINCT event_id) != 1
      OR sum(CASE side WHEN 'debit' THEN amount_cents ELSE -amount_cents END) != 0) bad`).Scan(&badOrders, &example)
	if err != nil {
		c.t.Fatal(err)
	}
	if badOrders != 0 {
		c.t.Errorf("%d orders do not have exactly one balanced debit/credit pair from one event (e.g. %s)", badOrders, example)
	}
	if n := c.countIn(c.ledgerPG, `SELECT count(DISTINCT order_id) FROM ledger_entries`); n != int64(len(produced)) {
		c.t.Errorf("the ledger booked %d orders, want %d", n, len(produced))
	}
	if n := c.countIn(c.ledgerPG, `SELECT count(*) FROM kfn.event_inbox WHERE consumer = $1 AND outcome = 'applied'`, ledger.Name); n != int64(len(produced)) {
		c.t.Errorf("the ledger's event inbox has %d applied events, want %d", n, len(produced))
	}
}

// requireNoDeadLetters checks that neither function dead-lettered anything:
// every produced order is valid.
func (c *chain) requireNoDeadLetters() {
	c.t.Helper()
	for _, pg := range c.databases() {
		rows, err := pg.Pool.Query(context.Background(), `SELECT consumer, topic, "offset", reason, error FROM kfn.dead_letters ORDER BY id LIMIT 5`)
		if err != nil {
			c.t.Fatal(err)
		}
		for rows.Next() {
			var consumer, topic, reason, msg string
			var offset int64
			if err := rows.Scan(&consumer, &topic, &offset, &reason, &msg); err != nil {
				c.t.Fatal(err)
			}
			c.t.Errorf("dead letter of %s from %s@%d: %s: %s", consumer, topic, offset, reason, msg)
		}
		rows.Close()
	}
}

// databases lists the chain's databases, each once.
func (c *chain) databases() []*kfntest.PG {
	if c.ledgerPG == c.pg {
		return []*kfntest.PG{c.pg}
	}
	return []*kfntest.PG{c.pg, c.ledgerPG}
}

// requireEventsOnce checks that subject holds one event per produced order
// (distinct Nats-Msg-Ids), each stored once, and that they name exactly the
// produced orders.
func requireEventsOnce(t *testing.T, js jetstream.JetStream, subject string, produced []orders.Order) {
	t.Helper()
	counts, bodies := streamIDs(t, js, subject)
	stored := 0
	for id, n := range counts {
		stored += n
		if id == "" {
			t.Errorf("%s: %d messages without a Nats-Msg-Id", subject, n)
		}
	}
	if len(counts) != len(produced) || stored != len(produced) {
		t.Errorf("%s: %d messages with %d distinct Nats-Msg-Ids in the stream, want %d and %d", subject, stored, len(counts), len(produced), len(produced))
	}
	want := map[string]bool{}
	for _, o := range produced {
		want[o.ID] = true
	}
	for id, body := range bodies {
		var ev struct {
			OrderID string `json:"order_id"`
		}
		if err := json.Unmarshal(body, &ev); err != nil || !want[ev.OrderID] {
			t.Errorf("%s: event %s is for order %q (%v), not a produced order", subject, id, ev.OrderID, err)
			continue
		}
		delete(want, ev.OrderID)
	}
	if len(want) != 0 {
		t.Errorf("%s: %d produced orders have no event", subject, len(want))
	}
}
