package systemtest_test

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestWALSlotLossIsRecoveredByReplayingWithTheEventIDsKept plays the
// recovery of docs/production/wal-outbox.md, "Slot loss", on the orders →
// ledger chain in WAL mode: orders go through while a relay reads the
// slot; then the relay stops, more orders are applied (their events wait
// in the slot), and the slot is dropped: those events are lost. The
// orders worker's next emit fails instead of writing events no slot
// holds. kfn migrate --outbox wal makes the slot again and gives the time
// of the last confirmation; kfn replay --reexecute --keep-event-ids from
// before it re-emits the orders' events with their original ids. In the
// end the ledger has booked every order exactly once.
func TestWALSlotLossIsRecoveredByReplayingWithTheEventIDsKept(t *testing.T) {
	const first, lost = 40, 40
	c := newWALRelayedChain(t, walOutbox)
	o, l := c.orders, c.ledger
	produce, booked := c.produceOrders, c.waitBooked
	produce(first)
	booked("the first orders to go through the chain", 60*time.Second)
	c.relay.Stop()

	// Orders applied with no relay: their events wait in the slot.
	produce(lost)
	waitUntil(t, 30*time.Second, "the orders to be applied", func() (bool, string) {
		n := c.tableCount("orders")
		return n == first+lost, fmt.Sprintf("%d of %d orders", n, first+lost)
	})
	time.Sleep(time.Second) // the orders worker's commits have emitted
	ctx := context.Background()
	st := c.walState()
	if _, err := c.pg.Pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, st.Slot); err != nil {
		t.Fatal(err)
	}
	// With the slot gone, an emit fails (the orders worker retries it).
	produce(1)
	waitUntil(t, 30*time.Second, "the orders worker to be refused its emit", func() (bool, string) {
		log := o.LogTail(200)
		return strings.Contains(log, "replication slot") && strings.Contains(log, "is gone"), "no refused emit in the log yet"
	})

	cmd := exec.Command(c.kfnBin, "migrate", "--outbox", "wal", "--database-url", c.pg.URL)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "WARNING: the slot had been lost") {
		t.Fatalf("kfn migrate --outbox wal after the loss: %v\n%s", err, out)
	}
	st = c.walState()
	if st.ConfirmedAt.IsZero() {
		t.Fatalf("no last confirmation recorded: %+v", st)
	}
	// From a little before the last confirmation: the records behind the
	// lost events were produced before they were applied.
	from := st.ConfirmedAt.Add(-5 * time.Second).UTC().Format(time.RFC3339Nano)
	replay := exec.Command(c.kfnBin, "replay", "--function", orders.Function().Name, "--topic", c.topic, "--from-time", from,
		"--reexecute", "--keep-event-ids", "--reason", "WAL outbox slot lost", "--wait", "--wait-timeout", "60s",
		"--database-url", c.pg.URL, "--nats-url", c.nats.URL, "--kafka-brokers", strings.Join(c.kafka.Brokers, ","))
	if out, err := replay.CombinedOutput(); err != nil {
		t.Fatalf("kfn replay: %v\n%s", err, out)
	}
	c.relay = kfntest.StartProcess(t, relayCmd(kfntest.BuildBinary(t, relayProcPkg), c.chain))
	booked("every order to be booked after the recovery", 60*time.Second)
	c.relay.Stop()
	stopClean(t, o, l)

	c.requireLedgerBalances(c.produced)
	c.requireNoDeadLetters()
	if _, err := outbox.ReadWALState(ctx, c.pg.Pool); err != nil {
		t.Fatal(err)
	}
	ids, _ := streamIDs(t, c.js, orders.AcceptedSubject)
	if len(ids) != len(c.produced) {
		t.Errorf("%d distinct orders.accepted events in the stream, want one per order (%d)", len(ids), len(c.produced))
	}
	t.Logf("%d orders, %d of whose events were lost with the slot; all booked once after kfn migrate --outbox wal and kfn replay --from-time %s --reexecute --keep-event-ids", len(c.produced), lost, from)
}
