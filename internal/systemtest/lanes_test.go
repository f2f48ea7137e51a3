package systemtest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

// TestPartitionedLedgerSurvivesAKilledWorker runs the ledger with 8 lanes
// over 3 worker processes while orders.accepted events arrive, 64 keys with
// many events each, and SIGKILLs one worker. Every worker must hold lanes
// before the kill; its lanes must move to the two others; every event must
// be booked once (the ledger balances, one debit/credit pair per order);
// and per key the events must be booked in stream order. It reports how
// long each of the killed worker's lanes stood still against the lease TTL.
func TestPartitionedLedgerSurvivesAKilledWorker(t *testing.T) {
	const (
		lanes   = 8
		keys    = 64
		total   = 3000
		perTick = 30
		tick    = 100 * time.Millisecond
		killAt  = 40 // tick
	)
	c, js := newLedgerChain(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	setting := fmt.Sprintf("KFN_LANES=%d", lanes)
	ws := []*worker{c.startLedger(setting), c.startLedger(setting), c.startLedger(setting)}

	// Wait for the final spread: 8 lanes, each worker at most ceil(8/3).
	var before map[string][]int
	waitUntil(t, 45*time.Second, "the 8 lanes to spread over the 3 workers", func() (bool, string) {
		requireAlive(t, ws...)
		before = c.laneOwners()
		n := 0
		for _, w := range ws {
			n += len(before[w.id])
			if len(before[w.id]) == 0 || len(before[w.id]) > 3 {
				return false, fmt.Sprintf("lanes by owner: %v", before)
			}
		}
		return n == lanes, fmt.Sprintf("lanes by owner: %v", before)
	})
	t.Logf("spread before the kill: %s", spread(before))

	p := newKeyedPublisher(t, js, keys)
	victim := ws[0]
	var killedAt time.Time
	start := time.Now()
	for i := 0; len(p.produced) < total; i++ {
		if wait := time.Until(start.Add(time.Duration(i) * tick)); wait > 0 {
			time.Sleep(wait)
		}
		p.publish(perTick)
		if i == killAt {
			victim.Kill()
			killedAt = time.Now()
			t.Logf("SIGKILL %s, which held lanes %v, after %d events", victim.id, before[victim.id], len(p.produced))
		}
		requireAlive(t, ws[1:]...)
	}
	t.Logf("published %d events over %d keys in %s", len(p.produced), keys, time.Since(start).Round(time.Millisecond))

	waitUntil(t, 45*time.Second, "the ledger to book every event", func() (bool, string) {
		entries := c.tableCount("ledger_entries")
		c.requireEntriesAtMost(entries, 2*total)
		return entries == 2*total, fmt.Sprintf("%d of %d ledger entries, lanes by owner %v", entries, 2*total, c.laneOwners())
	})
	after := c.laneOwners()
	t.Logf("spread after the kill: %s", spread(after))
	if len(after[victim.id]) != 0 {
		t.Errorf("the killed worker %s still owns lanes %v", victim.id, after[victim.id])
	}
	for _, w := range ws[1:] {
		if len(after[w.id]) != lanes/2 {
			t.Errorf("worker %s owns lanes %v after the kill; want %d of the %d", w.id, after[w.id], lanes/2, lanes)
		}
	}
	stopClean(t, ws[1:]...)

	c.requireLedgerBalances(p.produced)
	c.requireNoDeadLetters()
	c.requireKeyOrder(p.keyOf, p.seqOf)

	// How long the killed worker's lanes stood still: from the kill to the
	// first entry booked on each of them by its new owner.
	rows, err := c.pg.Pool.Query(ctx, `SELECT event_id, min(booked_at) FROM ledger_entries WHERE booked_at > $1 GROUP BY event_id`, killedAt)
	if err != nil {
		t.Fatal(err)
	}
	firstAfter := map[int]time.Time{}
	for rows.Next() {
		var id string
		var at time.Time
		if err := rows.Scan(&id, &at); err != nil {
			t.Fatal(err)
		}
		lane := outbox.LaneOf([]byte(p.keyOf[id]), lanes)
		if f, ok := firstAfter[lane]; !ok || at.Before(f) {
			firstAfter[lane] = at
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	var worst time.Duration
	var still []string
	for _, lane := range before[victim.id] {
		f, ok := firstAfter[lane]
		if !ok {
			t.Fatalf("lane %d of the killed worker booked nothing after the kill", lane)
		}
		d := f.Sub(killedAt)
		worst = max(worst, d)
		still = append(still, fmt.Sprintf("lane %d %s", lane, d.Round(time.Millisecond)))
	}
	t.Logf("the killed worker's lanes stood still: %s; worst %s = %.1f × the lease TTL (%s)",
		strings.Join(still, ", "), worst.Round(time.Millisecond), worst.Seconds()/leaseTTL.Seconds(), leaseTTL)
	if worst > 5*leaseTTL {
		t.Errorf("a lane stood still %s after the kill, more than 5 × the lease TTL (%s)", worst.Round(time.Millisecond), leaseTTL)
	}
}

// laneOwners returns the ledger's lanes by the worker that claimed each last.
func (c *chain) laneOwners() map[string][]int {
	c.t.Helper()
	rows, err := c.pg.Pool.Query(context.Background(),
		`SELECT owner, partition FROM kfn.cursors WHERE consumer = $1 AND topic = $2 ORDER BY partition`, ledger.Name, orders.AcceptedSubject)
	if err != nil {
		c.t.Fatal(err)
	}
	defer rows.Close()
	owners := map[string][]int{}
	for rows.Next() {
		var owner string
		var lane int
		if err := rows.Scan(&owner, &lane); err != nil {
			c.t.Fatal(err)
		}
		owners[owner] = append(owners[owner], lane)
	}
	if err := rows.Err(); err != nil {
		c.t.Fatal(err)
	}
	return owners
}

func spread(owners map[string][]int) string {
	var parts []string
	for _, w := range slices.Sorted(maps.Keys(owners)) {
		parts = append(parts, fmt.Sprintf("%s: %d lanes %v", w, len(owners[w]), owners[w]))
	}
	return strings.Join(parts, "; ")
}

// requireKeyOrder checks that, per key, the ledger booked the events in the
// order they were published: entry ids grow with the publish sequence.
func (c *chain) requireKeyOrder(keyOf map[string]string, seqOf map[string]int) {
	c.t.Helper()
	rows, err := c.pg.Pool.Query(context.Background(), `SELECT event_id FROM ledger_entries WHERE side = 'debit' ORDER BY id`)
	if err != nil {
		c.t.Fatal(err)
	}
	defer rows.Close()
	last := map[string]int{}
	bad := 0
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			c.t.Fatal(err)
		}
		key, seq := keyOf[id], seqOf[id]
		if prev, ok := last[key]; ok && seq < prev {
			if bad++; bad <= 5 {
				c.t.Errorf("key %s: event #%d booked after #%d", key, seq, prev)
			}
		}
		last[key] = seq
	}
	if err := rows.Err(); err != nil {
		c.t.Fatal(err)
	}
	if bad > 0 {
		c.t.Errorf("%d events booked out of their key's order", bad)
	}
}

// keyedPublisher publishes orders.accepted events as a relay would, order i
// under key i % keys, and remembers each event's key and publish number.
type keyedPublisher struct {
	t        *testing.T
	js       jetstream.JetStream
	keys     int
	produced []orders.Order
	keyOf    map[string]string
	seqOf    map[string]int
}

func newKeyedPublisher(t *testing.T, js jetstream.JetStream, keys int) *keyedPublisher {
	return &keyedPublisher{t: t, js: js, keys: keys, keyOf: map[string]string{}, seqOf: map[string]int{}}
}

// publish publishes the next n events and waits for their stream acks.
func (p *keyedPublisher) publish(n int) {
	p.t.Helper()
	for range n {
		i := len(p.produced)
		o := order(i)
		id := fmt.Sprintf("lanes-ev-%06d", i)
		key := fmt.Sprintf("key-%02d", i%p.keys)
		data, err := json.Marshal(o)
		if err != nil {
			p.t.Fatal(err)
		}
		m := nats.NewMsg(orders.AcceptedSubject)
		m.Header.Set(jetstream.MsgIDHeader, id)
		m.Header.Set(outbox.HeaderKey, key)
		m.Data = data
		if _, err := p.js.PublishMsgAsync(m); err != nil {
			p.t.Fatal(err)
		}
		p.produced = append(p.produced, o)
		p.keyOf[id], p.seqOf[id] = key, i
	}
	select {
	case <-p.js.PublishAsyncComplete():
	case <-time.After(10 * time.Second):
		p.t.Fatal("publishes not acked within 10s")
	}
}

// TestChangingTheLedgersLaneCount is the documented operation: the ledger
// runs 2 lanes on two workers; a worker started with 4 lanes switches the
// count while the old two still run and events keep coming; the old
// workers are refused (their lanes fenced, their claims turned down with a
// message naming --lanes) until they are restarted with 4 lanes. Every
// event is booked once and in its key's order.
func TestChangingTheLedgersLaneCount(t *testing.T) {
	const keys, perTick, tick = 32, 20, 100 * time.Millisecond
	c, js := newLedgerChain(t)
	p := newKeyedPublisher(t, js, keys)
	booked := func(what string) {
		t.Helper()
		waitUntil(t, 45*time.Second, what, func() (bool, string) {
			entries := c.tableCount("ledger_entries")
			c.requireEntriesAtMost(entries, 2*int64(len(p.produced)))
			return entries == 2*int64(len(p.produced)), fmt.Sprintf("%d of %d ledger entries, lanes by owner %v", entries, 2*len(p.produced), c.laneOwners())
		})
	}
	publishFor := func(ticks int) {
		for range ticks {
			p.publish(perTick)
			time.Sleep(tick)
		}
	}

	old := []*worker{c.startLedger("KFN_LANES=2"), c.startLedger("KFN_LANES=2")}
	publishFor(10)
	booked("the 2 lanes to book the first events")
	t.Logf("2 lanes: %s", spread(c.laneOwners()))

	// A worker with 4 lanes joins while events keep coming.
	newer := []*worker{c.startLedger("KFN_LANES=4")}
	waitUntil(t, 30*time.Second, "the newer worker to switch the count to 4", func() (bool, string) {
		p.publish(perTick)
		n := c.count(`SELECT count(*) FROM kfn.subject_lanes WHERE consumer = $1 AND lanes = 4`, ledger.Name)
		return n == 1, fmt.Sprintf("lanes by owner %v", c.laneOwners())
	})
	publishFor(10)
	waitUntil(t, 30*time.Second, "an old worker to be refused", func() (bool, string) {
		for _, w := range old {
			if strings.Contains(w.LogTail(200), "restart it with --lanes 4 (KFN_LANES)") {
				return true, ""
			}
		}
		return false, "no refusal logged yet"
	})

	// Restart the old workers with the new count.
	stopClean(t, old...)
	newer = append(newer, c.startLedger("KFN_LANES=4"), c.startLedger("KFN_LANES=4"))
	publishFor(10)
	booked("the 4 lanes to book every event")
	after := c.laneOwners()
	t.Logf("4 lanes: %s", spread(after))
	lanes := 0
	for _, ls := range after {
		lanes += len(ls)
	}
	if lanes != 4 {
		t.Errorf("%d cursor rows after the change, want the 4 lanes: %v", lanes, after)
	}
	if n := c.count(`SELECT count(*) FROM kfn.audit_log WHERE action = 'lanes_changed' AND consumer = $1`, ledger.Name); n < 2 {
		t.Errorf("%d lanes_changed rows in the audit log, want the change to 2 and the change to 4", n)
	}
	requireAlive(t, newer...)
	stopClean(t, newer...)
	c.requireLedgerBalances(p.produced)
	c.requireNoDeadLetters()
	c.requireKeyOrder(p.keyOf, p.seqOf)
}

// newLedgerChain is a chain whose event stream exists and captures the
// ledger's subjects, for tests that publish orders.accepted themselves.
func newLedgerChain(t *testing.T) (*chain, jetstream.JetStream) {
	t.Helper()
	c := newChain(t, 1)
	js := c.jetStream()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := outbox.ExtendStream(ctx, js, runtime.DefaultStream, []string{orders.AcceptedSubject, ledger.CapturedSubject}, outbox.StreamLimits{Duplicates: time.Minute, MaxAge: time.Hour}); err != nil {
		t.Fatal(err)
	}
	return c, js
}
