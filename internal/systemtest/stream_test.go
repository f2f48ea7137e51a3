package systemtest_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
)

// TestRelayPublishesSubjectsAddedToTheStreamAfterItStarted starts the orders
// worker first, so its relay (which works every relay shard at first) knows
// the event stream with orders.accepted only. The ledger worker starts right
// after and adds payments.captured to the stream, as every function does
// for its Emits. The orders worker's relay must then publish the ledger's
// payments.captured events promptly: the stream does capture them, so they
// must not be parked as if it did not.
func TestRelayPublishesSubjectsAddedToTheStreamAfterItStarted(t *testing.T) {
	const n = 20
	c := newChain(t, 2)
	js := c.jetStream()
	o1 := c.startOrders()
	waitStreamCovers(t, js, orders.AcceptedSubject)
	l1 := c.startLedger()
	waitStreamCovers(t, js, ledger.CapturedSubject)

	var produced []orders.Order
	for i := range n {
		produced = append(produced, order(i))
	}
	c.produce(produced, 0)
	start := time.Now()
	waitUntil(t, 15*time.Second, "every payments.captured event to be relayed", func() (bool, string) {
		entries, rows := c.tableCount("ledger_entries"), c.count(`SELECT count(*) FROM kfn.outbox`)
		c.requireEntriesAtMost(entries, 2*n)
		return entries == 2*n && rows == 0, fmt.Sprintf("%d of %d ledger entries, %d outbox rows left (subjects: %v)",
			entries, 2*n, rows, c.outboxSubjects())
	})
	t.Logf("relayed the whole chain %s after producing", time.Since(start).Round(time.Millisecond))
	stopClean(t, o1, l1)
	requireEventsOnce(t, js, ledger.CapturedSubject, produced)
}

// outboxSubjects counts the outbox rows per subject.
func (c *chain) outboxSubjects() map[string]int {
	c.t.Helper()
	rows, err := c.pg.Pool.Query(context.Background(), `SELECT subject, count(*) FROM kfn.outbox GROUP BY subject`)
	if err != nil {
		c.t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var s string
		var n int
		if err := rows.Scan(&s, &n); err != nil {
			c.t.Fatal(err)
		}
		out[s] = n
	}
	return out
}
