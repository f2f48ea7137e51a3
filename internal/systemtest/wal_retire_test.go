package systemtest_test

import (
	"bytes"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/functions/orders"
)

// TestDroppingTheWALOutboxWhileAWorkerStillEmitsLosesAndDuplicatesNothing
// plays "Switching modes" of docs/production/wal-outbox.md back to table
// on the orders → ledger chain: the orders worker emits into the WAL
// while a relay reads the slot; kfn migrate --drop-wal-outbox runs while
// the orders worker is still in wal mode and orders keep coming. The
// worker's emits are refused (it retries them: no dead letter), the
// command drains the slot with the relay and drops it; the worker,
// restarted with --outbox table, applies the waiting orders. Every order
// is booked once, its event once in the stream, and the relay never
// reports the slot lost.
func TestDroppingTheWALOutboxWhileAWorkerStillEmitsLosesAndDuplicatesNothing(t *testing.T) {
	const before, during = 40, 20
	c := newWALRelayedChain(t) // the ledger in table mode
	produce := c.produceOrders
	produce(before / 2)
	time.Sleep(300 * time.Millisecond)
	produce(before / 2) // they may still wait in the slot as the retirement starts
	slot := c.walState().Slot

	drop := exec.Command(c.kfnBin, "migrate", "--drop-wal-outbox", "--wait", "60s", "--database-url", c.pg.URL)
	var dropOut bytes.Buffer
	drop.Stdout, drop.Stderr = &dropOut, &dropOut
	if err := drop.Start(); err != nil {
		t.Fatal(err)
	}
	produce(during / 2) // applied before or after the retirement
	waitUntil(t, 60*time.Second, "the WAL outbox to be retired", func() (bool, string) {
		st := c.walState()
		return !st.RetiredAt.IsZero(), fmt.Sprintf("%+v", st)
	})
	produce(during / 2) // after it: their emits are refused until the worker runs in table mode
	waitUntil(t, 60*time.Second, "the orders worker, still in wal mode, to be refused its emit", func() (bool, string) {
		log := c.orders.LogTail(300)
		return strings.Contains(log, "is being retired"), "no refused emit in the log yet"
	})
	if err := drop.Wait(); err != nil || !strings.Contains(dropOut.String(), "replication slot "+slot+" dropped") {
		t.Fatalf("kfn migrate --drop-wal-outbox: %v\n%s\nrelay log:\n%s", err, dropOut.String(), c.relay.LogTail(30))
	}
	stopClean(t, c.orders)
	c.orders = c.startOrders(noRelay) // table mode, the default
	c.waitBooked("every order to be booked after the switch to table mode", 90*time.Second)
	c.relay.Stop()
	stopClean(t, c.orders, c.ledger)

	c.requireLedgerBalances(c.produced)
	c.requireNoDeadLetters()
	requireEventsOnce(t, c.js, orders.AcceptedSubject, c.produced)
	if st := c.walState(); st.SetUp {
		t.Errorf("after the drop the WAL outbox is still set up: %+v", st)
	}
	if n := c.count(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, slot); n != 0 {
		t.Errorf("the slot %s is still there", slot)
	}
	if log := c.relay.LogTail(1000); strings.Contains(log, "slot is gone") {
		t.Errorf("the relay reported the dropped slot lost:\n%s", log)
	}
	t.Logf("%d orders, %d of them produced during the retirement with the orders worker in wal mode; each booked once.\n%s", len(c.produced), during, dropOut.String())
}
