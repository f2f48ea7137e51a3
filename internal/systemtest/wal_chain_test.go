package systemtest_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

// walOutbox is the setting that puts a worker in WAL outbox mode.
const walOutbox = "KFN_OUTBOX=wal"

// setUpWAL does what `kfn migrate --outbox wal` does for the chain's database.
func (c *chain) setUpWAL() {
	c.t.Helper()
	if _, err := outbox.SetUpWAL(context.Background(), c.pg.Pool); err != nil {
		c.t.Fatalf("set up the WAL outbox: %v", err)
	}
}

// walState reads the WAL outbox's state.
func (c *chain) walState() outbox.WALState {
	c.t.Helper()
	st, err := outbox.ReadWALState(context.Background(), c.pg.Pool)
	if err != nil {
		c.t.Fatal(err)
	}
	return st
}

// waitSlotReader waits until a worker other than old reads the slot (its
// walsender is on it) and returns it and how long that took from since.
func (c *chain) waitSlotReader(old string, since time.Time, limit time.Duration) (string, time.Duration) {
	c.t.Helper()
	var reader string
	waitUntil(c.t, limit, "another relay to read the WAL outbox's slot", func() (bool, string) {
		st := c.walState()
		reader = st.Reader
		return st.Reader != "" && st.Reader != old && st.ActivePID != 0, fmt.Sprintf("reader %q, walsender pid %d", st.Reader, st.ActivePID)
	})
	return reader, time.Since(since)
}

// TestOrderChainInWALModeIsExactlyOnceWhileTheSlotReaderIsKilledAndFrozen
// runs the orders → ledger chain with both functions in WAL outbox mode
// (their events go into the WAL; the relay that holds the slot's lease,
// in one of the workers, reads them from the slot) while orders keep
// coming. It SIGKILLs the worker whose relay reads the slot, then
// SIGSTOPs the next one and wakes it (SIGCONT) after a standby took the
// slot over: the woken relay is fenced. Each takeover must come within
// the lease TTL plus the start of replication, and every order must be
// applied once by each stage, with each event once in the stream.
func TestOrderChainInWALModeIsExactlyOnceWhileTheSlotReaderIsKilledAndFrozen(t *testing.T) {
	const (
		partitions = 4
		total      = 1200
		perTick    = 20
		tick       = 100 * time.Millisecond
		killAt     = 15
		freezeAt   = 35
		// A takeover waits for the holder's lease to expire (TTL), then
		// fences the slot, ends the old walsender and starts replication.
		takeoverLimit = leaseTTL + 3*time.Second
	)
	c := newChain(t, partitions)
	c.setUpWAL()
	js := c.jetStream()
	workers := map[string]*worker{}
	stages := map[string]string{}
	start := func(stage string) *worker {
		var w *worker
		if stage == "orders" {
			w = c.startOrders(walOutbox)
		} else {
			w = c.startLedger(walOutbox)
		}
		workers[w.id], stages[w.id] = w, stage
		return w
	}
	// The ledger first, so that the stream captures both subjects before
	// the orders' events come.
	start("ledger")
	waitStreamCovers(t, js, ledger.CapturedSubject)
	start("ledger")
	start("orders")
	start("orders")
	first, _ := c.waitSlotReader("", time.Now(), 30*time.Second)
	t.Logf("the slot is read by %s", first)

	var produced []orders.Order
	var frozen *worker
	var fenceAtTakeover int64
	var takeovers []time.Duration
	begin := time.Now()
	for i := 0; len(produced) < total; i++ {
		if wait := time.Until(begin.Add(time.Duration(i) * tick)); wait > 0 {
			time.Sleep(wait)
		}
		batch := make([]orders.Order, perTick)
		for j := range batch {
			batch[j] = order(len(produced) + j)
		}
		c.produce(batch, len(produced))
		produced = append(produced, batch...)

		switch i {
		case killAt:
			reader := c.walState().Reader
			victim := workers[reader]
			if victim == nil {
				t.Fatalf("the slot's reader %q is not one of the workers", reader)
			}
			killed := time.Now()
			victim.Kill()
			delete(workers, reader)
			next, took := c.waitSlotReader(reader, killed, takeoverLimit)
			takeovers = append(takeovers, took)
			t.Logf("SIGKILL %s (the slot's reader, %s stage): %s reads the slot %v later (lease TTL %v)", reader, stages[reader], next, took.Round(time.Millisecond), leaseTTL)
			start(stages[reader])
		case freezeAt:
			reader := c.walState().Reader
			frozen = workers[reader]
			if frozen == nil {
				t.Fatalf("the slot's reader %q is not one of the workers", reader)
			}
			stopped := time.Now()
			frozen.Pause()
			tokenBefore := c.walState().FenceToken
			next, took := c.waitSlotReader(reader, stopped, takeoverLimit)
			takeovers = append(takeovers, took)
			if fenceAtTakeover = c.walState().FenceToken; fenceAtTakeover <= tokenBefore {
				t.Fatalf("the takeover left the slot's fence at %d, not above the frozen reader's %d", fenceAtTakeover, tokenBefore)
			}
			frozen.Resume()
			t.Logf("SIGSTOP %s (the slot's reader): %s reads the slot %v later; SIGCONT %s", reader, next, took.Round(time.Millisecond), reader)
		}
		requireAlive(t, slices.Collect(maps.Values(workers))...)
	}
	t.Logf("produced %d orders in %s", len(produced), time.Since(begin).Round(time.Millisecond))

	drainStart := time.Now()
	waitUntil(t, 90*time.Second, "the chain to drain", func() (bool, string) {
		ordersRows, entries := c.tableCount("orders"), c.tableCount("ledger_entries")
		c.requireEntriesAtMost(entries, 2*total)
		idle, consumer := consumerIdle(js)
		st := c.walState()
		accepted, captured := subjectCount(t, js, orders.AcceptedSubject), subjectCount(t, js, ledger.CapturedSubject)
		if ordersRows != total || entries != 2*total || !idle || accepted != total || captured != total {
			return false, fmt.Sprintf("orders %d/%d, ledger entries %d/%d, %s, events in the stream %d and %d of %d, slot: %d pending, %d bytes held",
				ordersRows, total, entries, 2*total, consumer, accepted, captured, total, st.Pending, st.LagBytes)
		}
		return true, ""
	})
	t.Logf("drained %s after production stopped", time.Since(drainStart).Round(time.Millisecond))
	// The woken relay may read the slot again, but only under a lease it
	// took after the takeover: with a token above the one that fenced it.
	if st := c.walState(); st.Reader == frozen.id && st.FenceToken <= fenceAtTakeover {
		t.Errorf("the woken relay %s reads the slot with fence %d, not above the takeover's %d", frozen.id, st.FenceToken, fenceAtTakeover)
	}
	requireAlive(t, slices.Collect(maps.Values(workers))...)
	stopClean(t, slices.Collect(maps.Values(workers))...)

	c.requireOrdersOnce(produced)
	c.requireLedgerBalances(produced)
	c.requireNoDeadLetters()
	if n := c.count(`SELECT count(*) FROM kfn.outbox`); n != 0 {
		t.Errorf("kfn.outbox holds %d rows in WAL mode, want 0", n)
	}
	requireEventsOnce(t, js, orders.AcceptedSubject, produced)
	requireEventsOnce(t, js, ledger.CapturedSubject, produced)
	for _, took := range takeovers {
		if took > takeoverLimit {
			t.Errorf("a takeover of the slot took %v, over %v", took, takeoverLimit)
		}
	}
}

// subjectCount is how many messages the event stream holds on subject.
func subjectCount(t *testing.T, js jetstream.JetStream, subject string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	stream, err := js.Stream(ctx, runtime.DefaultStream)
	if err != nil {
		return 0
	}
	info, err := stream.Info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		return 0
	}
	return int(info.State.Subjects[subject])
}
