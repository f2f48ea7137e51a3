package systemtest_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

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

	// The frozen owner must hold events JetStream delivered to it. It holds
	// what its last pull request brought before the freeze; a subject lane's
	// pull lives 2 s, so events that reach the stream after it expired stay
	// pending and the frozen owner holds none. Then the owner is woken to
	// book them and frozen again, until a freeze holds some.
	var holding int
	for attempt := 1; holding == 0; attempt++ {
		if attempt > 5 {
			t.Fatalf("in %d freezes of the ledger's owner, JetStream never delivered it an event before its pull request expired", attempt-1)
		}
		l1.Pause()
		produce(held)
		var ackPending, pending int
		waitUntil(t, 30*time.Second, "every new event to reach the frozen owner's consumer", func() (bool, string) {
			var err error
			ackPending, pending, err = ledgerConsumerCounts(js)
			if err != nil {
				return false, err.Error()
			}
			return ackPending+pending == held, fmt.Sprintf("%d awaiting ack, %d pending", ackPending, pending)
		})
		t.Logf("freeze %d: the frozen owner holds %d of %d new events (awaiting its ack), %d pending", attempt, ackPending, held, pending)
		holding = ackPending
		if holding == 0 {
			l1.Resume()
			waitUntil(t, 30*time.Second, "the woken owner to book the pending events", func() (bool, string) {
				n := c.tableCount("ledger_entries")
				idle, consumer := consumerIdle(js)
				return n == 2*int64(len(produced)) && idle, fmt.Sprintf("%d of %d ledger entries, %s", n, 2*len(produced), consumer)
			})
		}
	}
	l1.Kill()
	killedAt := time.Now()
	l2 := c.startLedger()

	waitUntil(t, 30*time.Second, "the replacement to book the events the dead owner held", func() (bool, string) {
		n := c.tableCount("ledger_entries")
		c.requireEntriesAtMost(n, 2*int64(len(produced)))
		idle, consumer := consumerIdle(js)
		return n == 2*int64(len(produced)) && idle, fmt.Sprintf("%d of %d ledger entries, lane owner %q, %s", n, 2*len(produced), c.laneOwner(), consumer)
	})
	t.Logf("booked the %d events the dead owner held, and the rest, %s after its kill", holding, time.Since(killedAt).Round(time.Millisecond))
	stopClean(t, ow, l2)
	c.requireLedgerBalances(produced)
	c.requireNoDeadLetters()
}

// ledgerConsumerCounts returns the ledger consumer's delivered, unacked
// events and those not delivered yet.
func ledgerConsumerCounts(js jetstream.JetStream) (ackPending, pending int, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cons, err := js.Consumer(ctx, runtime.DefaultStream, "ledger")
	if err != nil {
		return 0, 0, err
	}
	ci, err := cons.Info(ctx)
	if err != nil {
		return 0, 0, err
	}
	return ci.NumAckPending, int(ci.NumPending), nil
}
