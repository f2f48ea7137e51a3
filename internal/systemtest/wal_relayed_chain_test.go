package systemtest_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// walRelayedChain is the orders → ledger chain with the WAL outbox set
// up, its workers started without their own relays, and one relay
// process reading the outbox table and the slot.
type walRelayedChain struct {
	*chain
	js             jetstream.JetStream
	kfnBin         string
	relay          *kfntest.Process
	orders, ledger *worker
	produced       []orders.Order
}

// noRelay starts a worker without its own relay.
const noRelay = "KFN_NO_RELAY=true"

// newWALRelayedChain starts it, the orders worker in wal mode and the
// ledger worker with ledgerEnv.
func newWALRelayedChain(t *testing.T, ledgerEnv ...string) *walRelayedChain {
	c := &walRelayedChain{chain: newChain(t, 2)}
	c.setUpWAL()
	c.js = c.jetStream()
	c.kfnBin = kfntest.BuildBinary(t, "github.com/kfn-dev/kfn/cmd/kfn")
	relayBin := kfntest.BuildBinary(t, relayProcPkg)
	c.ledger = c.startLedger(append(ledgerEnv, noRelay)...)
	waitStreamCovers(t, c.js, ledger.CapturedSubject)
	c.orders = c.startOrders(walOutbox, noRelay)
	waitStreamCovers(t, c.js, orders.AcceptedSubject)
	c.relay = kfntest.StartProcess(t, relayCmd(relayBin, c.chain))
	return c
}

// produceOrders produces the next n orders.
func (c *walRelayedChain) produceOrders(n int) {
	batch := make([]orders.Order, n)
	for j := range batch {
		batch[j] = order(len(c.produced) + j)
	}
	c.produce(batch, len(c.produced))
	c.produced = append(c.produced, batch...)
}

// waitBooked waits until the ledger has booked every produced order (two
// entries each) and its consumer is idle.
func (c *walRelayedChain) waitBooked(what string, limit time.Duration) {
	c.t.Helper()
	entries := int64(2 * len(c.produced))
	if !kfntest.Await(c.t, limit, what, func() (bool, string) {
		n := c.tableCount("ledger_entries")
		c.requireEntriesAtMost(n, entries)
		idle, consumer := consumerIdle(c.js)
		return n == entries && idle, fmt.Sprintf("%d of %d ledger entries, %s, slot %+v", n, entries, consumer, c.walState())
	}) {
		c.t.Fatalf("relay log:\n%s\norders worker log:\n%s", c.relay.LogTail(30), c.orders.LogTail(30))
	}
}
