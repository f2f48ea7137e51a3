package systemtest_test

import (
	"bytes"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime/kfntest"
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
	c := newChain(t, 2)
	c.setUpWAL()
	js := c.jetStream()
	kfnBin := kfntest.BuildBinary(t, "github.com/kfn-dev/kfn/cmd/kfn")
	relayBin := kfntest.BuildBinary(t, relayProcPkg)
	noRelay := "KFN_NO_RELAY=true"
	l := c.startLedger(noRelay)
	waitStreamCovers(t, js, ledger.CapturedSubject)
	o := c.startOrders(walOutbox, noRelay)
	waitStreamCovers(t, js, orders.AcceptedSubject)
	relay := kfntest.StartProcess(t, relayCmd(relayBin, c))

	var produced []orders.Order
	produce := func(n int) {
		batch := make([]orders.Order, n)
		for j := range batch {
			batch[j] = order(len(produced) + j)
		}
		c.produce(batch, len(produced))
		produced = append(produced, batch...)
	}
	booked := func(what string) {
		t.Helper()
		entries := int64(2 * len(produced))
		if !kfntest.Await(t, 90*time.Second, what, func() (bool, string) {
			n := c.tableCount("ledger_entries")
			c.requireEntriesAtMost(n, entries)
			idle, consumer := consumerIdle(js)
			return n == entries && idle, consumer
		}) {
			t.Fatalf("relay log:\n%s\norders worker log:\n%s", relay.LogTail(30), o.LogTail(30))
		}
	}
	produce(before / 2)
	time.Sleep(300 * time.Millisecond)
	produce(before / 2) // the second half may still wait in the slot as the retirement starts
	slot := c.walState().Slot

	drop := exec.Command(kfnBin, "migrate", "--drop-wal-outbox", "--wait", "60s", "--database-url", c.pg.URL)
	var dropOut bytes.Buffer
	drop.Stdout, drop.Stderr = &dropOut, &dropOut
	if err := drop.Start(); err != nil {
		t.Fatal(err)
	}
	produce(during)
	waitUntil(t, 60*time.Second, "the orders worker, still in wal mode, to be refused its emit", func() (bool, string) {
		log := o.LogTail(300)
		return strings.Contains(log, "is being retired"), "no refused emit in the log yet"
	})
	if err := drop.Wait(); err != nil || !strings.Contains(dropOut.String(), "replication slot "+slot+" dropped") {
		t.Fatalf("kfn migrate --drop-wal-outbox: %v\n%s\nrelay log:\n%s", err, dropOut.String(), relay.LogTail(30))
	}
	stopClean(t, o)
	o = c.startOrders(noRelay) // table mode, the default
	booked("every order to be booked after the switch to table mode")
	relay.Stop()
	stopClean(t, o, l)

	c.requireLedgerBalances(produced)
	c.requireNoDeadLetters()
	requireEventsOnce(t, js, orders.AcceptedSubject, produced)
	if st := c.walState(); st.SetUp {
		t.Errorf("after the drop the WAL outbox is still set up: %+v", st)
	}
	if n := c.count(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, slot); n != 0 {
		t.Errorf("the slot %s is still there", slot)
	}
	if log := relay.LogTail(1000); strings.Contains(log, "slot is gone") {
		t.Errorf("the relay reported the dropped slot lost:\n%s", log)
	}
	t.Logf("%d orders, %d of them produced during the retirement with the orders worker in wal mode; each booked once.\n%s", len(produced), during, dropOut.String())
}
