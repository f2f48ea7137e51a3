package systemtest_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/operator"
)

// TestReexecutionKeepsOrRenewsEventIDsDownstream re-executes orders
// 5..14 twice through the orders → ledger chain. With --keep-event-ids the
// re-executed orders emit their original event ids, JetStream drops them as
// repeats, and the ledger books nothing new. With new ids (the default) the
// ledger books those ten orders again: what a re-execution must do when the
// downstream effect is meant to happen again, and what keep-event-ids
// exists to prevent when it is not.
func TestReexecutionKeepsOrRenewsEventIDsDownstream(t *testing.T) {
	c := newChain(t, 1)
	js := c.jetStream()
	ordersWorker, ledgerWorker := c.startOrders(), c.startLedger()
	ordersWorker.waitStarted(t)
	ledgerWorker.waitStarted(t)
	batch := make([]orders.Order, 20)
	for i := range batch {
		batch[i] = order(i)
	}
	c.produce(batch, 0)
	settled := func(entries int64) {
		t.Helper()
		waitUntil(t, 90*time.Second, fmt.Sprintf("the ledger to settle at %d entries", entries), func() (bool, string) {
			cur, err := inbox.ReadCursor(context.Background(), c.pg.Pool, inbox.Partition{Consumer: "orders", Topic: c.topic, Partition: 0})
			if err != nil || cur.NextOffset < 20 {
				return false, fmt.Sprintf("orders cursor %d (%v)", cur.NextOffset, err)
			}
			if n := c.tableCount("kfn.outbox"); n != 0 {
				return false, fmt.Sprintf("%d outbox rows not relayed yet", n)
			}
			if idle, why := consumerIdle(js); !idle {
				return false, why
			}
			got := c.tableCount("ledger_entries")
			c.requireEntriesAtMost(got, entries)
			return got == entries, fmt.Sprintf("%d ledger entries", got)
		})
	}
	settled(40) // 2 entries per order

	reexecute := func(keep bool) {
		t.Helper()
		_, err := operator.Replay(context.Background(), c.pg.Pool, js, operator.ReplaySpec{
			Function: "orders", Topic: c.topic, Partitions: []int32{0}, From: 5, KafkaBrokers: c.kafka.Brokers,
			ReplayOptions: inbox.ReplayOptions{To: 15, Reexecute: true, KeepEventIDs: keep, Reason: "test", Actor: "test"},
		})
		if err != nil {
			t.Fatalf("re-execute 5..14 (keep event ids: %v): %v", keep, err)
		}
	}
	reexecute(true)
	settled(40)
	// settled only returns once the re-executed events were relayed and the
	// ledger's consumer is idle: had any reached the ledger, it would hold
	// more entries (requireEntriesAtMost fails at once).
	if n := c.count(`SELECT count(*) FROM orders WHERE revisions > 1`); n != 10 {
		t.Errorf("%d orders were applied again, want the 10 re-executed", n)
	}

	reexecute(false)
	settled(60) // the ten orders booked again: 20 more entries
	stopClean(t, ordersWorker, ledgerWorker)
}
