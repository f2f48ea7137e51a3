package systemtest_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// relayProcPkg is the outbox's fault-injection relay: a relay process that
// SIGKILLs itself at a chosen publish or ack.
const relayProcPkg = "github.com/kfn-dev/kfn/outbox/internal/relayproc"

// With a NATS outage longer than the duplicate window, the downstream
// function still applies each event once.
//
// The relay dies after JetStream stored a batch of orders.accepted events
// but before it deleted their outbox rows; the ledger books them. Then NATS
// is down for longer than the stream's duplicate window (KFN_EVENT_DEDUP=1s),
// and when it is back the orders worker's relay publishes the rows again.
// JetStream no longer knows their Nats-Msg-Ids and stores every event a
// second time; the ledger's event inbox must drop each repeat.
func TestLedgerAppliesEventsOnceWhenTheyAreRepublishedAfterTheDuplicateWindow(t *testing.T) {
	const (
		window = time.Second
		warmup = 10
		held   = 10 // events republished after the window
	)
	c := newChain(t, 2)
	js := c.jetStream()
	dedup := "KFN_EVENT_DEDUP=" + window.String()
	noRelay := "KFN_NO_RELAY=true"
	relayBin := kfntest.BuildBinary(t, relayProcPkg)

	var produced []orders.Order
	produce := func(batch []orders.Order) {
		c.produce(batch, len(produced))
		produced = append(produced, batch...)
	}
	drained := func(what string, entries int64) {
		t.Helper()
		waitUntil(t, 30*time.Second, what, func() (bool, string) {
			n, rows := c.tableCount("ledger_entries"), c.count(`SELECT count(*) FROM kfn.outbox`)
			c.requireEntriesAtMost(n, entries)
			idle, consumer := consumerIdle(js)
			return n == entries && rows == 0 && idle, fmt.Sprintf("%d of %d ledger entries, %d outbox rows, %s", n, entries, rows, consumer)
		})
	}

	// 1. Both functions with their relays: they create the event stream
	// with the short duplicate window, and the chain works end to end. They
	// start one after the other, so that each relay starts after the stream
	// captures both subjects (see TestRelayPublishesSubjectsAddedToTheStream).
	first := c.startOrders(dedup)
	first.waitStarted(t)
	waitStreamCovers(t, js, orders.AcceptedSubject)
	stopClean(t, first)
	l1 := c.startLedger(dedup)
	waitStreamCovers(t, js, ledger.CapturedSubject)
	o1 := c.startOrders(dedup)
	var warm []orders.Order
	for i := range warmup {
		warm = append(warm, order(i))
	}
	produce(warm)
	drained("the warm-up orders to go through the chain", 2*warmup)
	stopClean(t, o1, l1)
	ctx := context.Background()
	stream, err := js.Stream(ctx, runtime.DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	if got := stream.CachedInfo().Config.Duplicates; got != window {
		t.Fatalf("the workers created %s with a duplicate window of %s, want KFN_EVENT_DEDUP=%s", runtime.DefaultStream, got, window)
	}

	// 2. Orders accepted with no relay running: their events wait in the
	// outbox. They share one relay shard, so one relay batch holds them all.
	o2 := c.startOrders(noRelay)
	heldOrders := sameShardOrders(warmup, held)
	produce(heldOrders)
	waitUntil(t, 30*time.Second, "the held orders' events in the outbox", func() (bool, string) {
		n := c.count(`SELECT count(*) FROM kfn.outbox WHERE subject = $1`, orders.AcceptedSubject)
		return n == held, fmt.Sprintf("%d of %d outbox rows", n, held)
	})
	stopClean(t, o2)

	// 3. A relay publishes them and dies when the last ack arrives, before
	// it deletes any row.
	relay := kfntest.StartProcess(t, relayCmd(relayBin, c, "KFN_KILL_AFTER_ACK="+strconv.Itoa(held)))
	waitKilledAtFaultPoint(t, relay, 30*time.Second)
	ids, _ := streamIDs(t, js, orders.AcceptedSubject)
	if n := c.count(`SELECT count(*) FROM kfn.outbox`); n != held || len(ids) != warmup+held {
		t.Fatalf("after the relay crash: %d outbox rows and %d orders.accepted events in the stream, want %d (none deleted) and %d (all published)", n, len(ids), held, warmup+held)
	}

	// 4. The ledger books them (its own relay stays off, so nothing is
	// republished yet).
	l2 := c.startLedger(noRelay)
	waitUntil(t, 30*time.Second, "the ledger to book the held events", func() (bool, string) {
		n := c.tableCount("ledger_entries")
		c.requireEntriesAtMost(n, 2*int64(len(produced)))
		idle, consumer := consumerIdle(js)
		return n == 2*int64(len(produced)) && idle, fmt.Sprintf("%d of %d ledger entries, %s", n, 2*len(produced), consumer)
	})

	// 5. NATS is down for longer than the duplicate window.
	c.nats.Stop()
	time.Sleep(2 * window)
	if err := c.nats.Start(); err != nil {
		t.Fatal(err)
	}

	// 6. The orders worker's relay comes back and publishes the rows again.
	o3 := c.startOrders(dedup)
	drained("the republished events to be relayed and consumed", 2*int64(len(produced)))
	requireAlive(t, o3, l2)
	stopClean(t, o3, l2)

	counts, _ := streamIDs(t, js, orders.AcceptedSubject)
	heldIDs := map[string]bool{}
	for _, o := range heldOrders {
		heldIDs[o.ID] = true
	}
	twice := 0
	for id, n := range counts {
		switch n {
		case 1:
		case 2:
			twice++
		default:
			t.Errorf("event %s is stored %d times", id, n)
		}
	}
	if twice != held || len(counts) != len(produced) {
		t.Fatalf("%d orders.accepted events of %d distinct are stored twice, want the %d held ones of %d: the republish must land after the duplicate window",
			twice, len(counts), held, len(produced))
	}
	c.requireOrdersOnce(produced)
	c.requireLedgerBalances(produced)
	c.requireNoDeadLetters()
	requireEventsOnce(t, js, ledger.CapturedSubject, produced)
	if n := c.count(`SELECT count(*) FROM kfn.outbox`); n != 0 {
		t.Errorf("kfn.outbox holds %d rows, want 0", n)
	}
}

// sameShardOrders returns n orders, numbered from first on, whose events
// all fall into one relay shard.
func sameShardOrders(first, n int) []orders.Order {
	var out []orders.Order
	shard := -1
	for i := first; len(out) < n; i++ {
		o := order(i)
		s := outbox.ShardOf(o.ID)
		if shard < 0 {
			shard = s
		}
		if s == shard {
			out = append(out, o)
		}
	}
	return out
}

// relayCmd runs relayproc on the chain's database and NATS server, relaying
// both subjects of the chain; extra holds KEY=value settings.
func relayCmd(bin string, c *chain, extra ...string) *exec.Cmd {
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(),
		"KFN_DATABASE_URL="+c.pg.URL,
		"KFN_NATS_URL="+c.nats.URL,
		"KFN_STREAM="+runtime.DefaultStream,
		"KFN_SUBJECTS="+orders.AcceptedSubject+","+ledger.CapturedSubject,
	)
	cmd.Env = append(cmd.Env, extra...)
	return cmd
}

// waitKilledAtFaultPoint waits for relayproc to SIGKILL itself at its fault
// point.
func waitKilledAtFaultPoint(t *testing.T, p *kfntest.Process, timeout time.Duration) {
	t.Helper()
	select {
	case <-p.Exited():
	case <-time.After(timeout):
		t.Fatalf("relayproc did not reach its fault point within %v; output:\n%s", timeout, p.LogTail(40))
	}
	var exitErr *exec.ExitError
	ws, ok := syscall.WaitStatus(0), false
	if errors.As(p.ExitErr(), &exitErr) {
		ws, ok = exitErr.Sys().(syscall.WaitStatus)
	}
	if !ok || ws.Signal() != syscall.SIGKILL || !strings.Contains(p.LogTail(40), "fault point reached") {
		t.Fatalf("relayproc exited with %v, want SIGKILL at its fault point; output:\n%s", p.ExitErr(), p.LogTail(40))
	}
}
