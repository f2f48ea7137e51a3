package systemtest_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime"
)

// TestLedgerTakeoverResumesEventsTheDeadOwnerHeld freezes the ledger's lane
// owner (SIGSTOP) so that JetStream delivers new events to it that it never
// acks, then kills it. Its replacement must book those events as soon as it
// holds the lane (lease TTL plus a little), not only when JetStream's ack
// wait for the dead owner's deliveries runs out.
func TestLedgerTakeoverResumesEventsTheDeadOwnerHeld(t *testing.T) {
	const before, held = 20, 50
	c := newChain(t, 2)
	js := c.jetStream()
	ow := c.startOrders()
	l1 := c.startLedger()

	var produced []orders.Order
	produce := func(n int) {
		batch := make([]orders.Order, n)
		for j := range batch {
			batch[j] = order(len(produced) + j)
		}
		c.produce(batch, len(produced))
		produced = append(produced, batch...)
	}
	produce(before)
	waitUntil(t, 30*time.Second, "the first orders to be booked", func() (bool, string) {
		n := c.tableCount("ledger_entries")
		c.requireEntriesAtMost(n, 2*before)
		idle, consumer := consumerIdle(js)
		return n == 2*before && idle, fmt.Sprintf("%d ledger entries, %s", n, consumer)
	})
	if owner := c.laneOwner(); owner != l1.id {
		t.Fatalf("lane owner is %q, want %s", owner, l1.id)
	}

	l1.Pause()
	produce(held)
	waitUntil(t, 30*time.Second, "JetStream to deliver the new events to the frozen owner", func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		cons, err := js.Consumer(ctx, runtime.DefaultStream, "ledger")
		if err != nil {
			return false, err.Error()
		}
		ci, err := cons.Info(ctx)
		if err != nil {
			return false, err.Error()
		}
		return ci.NumAckPending == held, fmt.Sprintf("%d awaiting ack, %d pending", ci.NumAckPending, ci.NumPending)
	})
	l1.Kill()
	killedAt := time.Now()
	l2 := c.startLedger()

	waitUntil(t, 30*time.Second, "the replacement to book the events the dead owner held", func() (bool, string) {
		n := c.tableCount("ledger_entries")
		c.requireEntriesAtMost(n, 2*int64(len(produced)))
		idle, consumer := consumerIdle(js)
		return n == 2*int64(len(produced)) && idle, fmt.Sprintf("%d of %d ledger entries, lane owner %q, %s", n, 2*len(produced), c.laneOwner(), consumer)
	})
	t.Logf("booked %d events held by the dead owner %s after its kill", held, time.Since(killedAt).Round(time.Millisecond))
	stopClean(t, ow, l2)
	c.requireLedgerBalances(produced)
	c.requireNoDeadLetters()
}
