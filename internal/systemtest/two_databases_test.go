package systemtest_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestOrderChainOnTwoPostgresServersIsExactlyOnceThroughARestartOfEach
// deploys the chain with each function on a Postgres server of its own
// (the functions are joined only by NATS): 2 orders workers on one, 2
// ledger workers on the other. While orders keep coming it stops the
// orders' server for a second and starts it again, then the ledger's.
// Each of 100 order keys gets 20 revisions whose amount carries a per-key
// sequence number, so that a loss, a duplicate or a reordering shows in
// each stage (the backlog of a restart puts several revisions of a key in
// one batch): the orders row must hold the last revision and count 20,
// the ledger must have booked the revisions of each key once each, in
// sequence order, and each stream must hold every event once. Each restart's stall, from the
// server accepting connections again to the first commit of each lane on
// it, is logged and checked against the lease TTL. Then kfn verify checks
// both functions and kfn status shows both, each told its function's
// database by --function-databases.
func TestOrderChainOnTwoPostgresServersIsExactlyOnceThroughARestartOfEach(t *testing.T) {
	const (
		partitions = 4
		keys       = 100
		revisions  = 20
		total      = keys * revisions
		perTick    = 20
		tick       = 100 * time.Millisecond
		downtime   = time.Second
	)
	ordersServer, ledgerServer := kfntest.NewPrivatePostgres(t), kfntest.NewPrivatePostgres(t)
	c := newChainOn(t, partitions, ordersServer.PG, ledgerServer.PG)
	js := c.jetStream()
	ws := []*worker{c.startOrders(), c.startOrders(), c.startLedger(), c.startLedger()}

	// The restarts, in ticks of production: each runs beside it.
	type restart struct {
		at       int
		function string
		server   *kfntest.PrivatePostgres
	}
	restarts := []restart{{25, "orders", ordersServer}, {60, "ledger", ledgerServer}}
	var wg sync.WaitGroup
	stalls := make([]map[string]time.Duration, len(restarts))
	var ledgerAtRestart int64

	start := time.Now()
	for i := 0; i*perTick < total; i++ {
		if wait := time.Until(start.Add(time.Duration(i) * tick)); wait > 0 {
			time.Sleep(wait)
		}
		msgs := make([]kafka.Message, perTick)
		for j := range msgs {
			msgs[j] = revisionMessage(i*perTick+j, keys, partitions)
		}
		c.kafka.Produce(t, c.topic, msgs...)
		for n, r := range restarts {
			if r.at != i {
				continue
			}
			if r.function == "ledger" {
				ledgerAtRestart = c.tableCount("ledger_entries")
			}
			wg.Go(func() { stalls[n] = restartUnderLoad(t, c, r.function, r.server, downtime) })
		}
		requireAlive(t, ws...)
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	t.Logf("produced %d records (%d keys × %d revisions) in %s", total, keys, revisions, time.Since(start).Round(time.Millisecond))
	if ledgerAtRestart == 0 || ledgerAtRestart >= 2*total {
		t.Fatalf("the ledger had %d of %d entries when its server stopped: the restart must come while it books", ledgerAtRestart, 2*total)
	}
	for n, r := range restarts {
		lanes := slices.Sorted(maps.Keys(stalls[n]))
		shown := make([]string, len(lanes))
		for i, lane := range lanes {
			stall := stalls[n][lane]
			shown[i] = fmt.Sprintf("%s %s", lane, stall.Round(time.Millisecond))
			if stall > leaseTTL {
				t.Errorf("%s of %s stood still %s after its server was back, longer than the lease TTL (%s)", lane, r.function, stall.Round(time.Millisecond), leaseTTL)
			}
		}
		t.Logf("restart of the %s server (down %s): each lane committed again after the server was back: %s (lease TTL %s)", r.function, downtime, strings.Join(shown, ", "), leaseTTL)
	}

	waitUntil(t, 60*time.Second, "the chain to drain", func() (bool, string) {
		applied := c.countIn(c.pg, `SELECT coalesce(sum(revisions), 0) FROM orders`)
		entries := c.tableCount("ledger_entries")
		c.requireEntriesAtMost(entries, 2*total)
		outboxes := c.countIn(c.pg, `SELECT count(*) FROM kfn.outbox`) + c.countIn(c.ledgerPG, `SELECT count(*) FROM kfn.outbox`)
		idle, consumer := consumerIdle(js)
		return applied == total && entries == 2*total && outboxes == 0 && idle,
			fmt.Sprintf("orders revisions %d/%d, ledger entries %d/%d, outbox rows %d, %s", applied, total, entries, 2*total, outboxes, consumer)
	})
	requireAlive(t, ws...)
	stopClean(t, ws...)

	requireRevisionsInOrder(t, c, keys, revisions)
	c.requireNoDeadLetters()
	if n := c.countIn(c.ledgerPG, `SELECT count(*) FROM kfn.event_inbox WHERE consumer = $1 AND outcome = 'applied'`, ledger.Name); n != total {
		t.Errorf("the ledger's event inbox holds %d applied events, want %d", n, total)
	}
	for _, subject := range []string{orders.AcceptedSubject, ledger.CapturedSubject} {
		counts, _ := streamIDs(t, js, subject)
		for id, n := range counts {
			if n != 1 {
				t.Errorf("%s: event %s is stored %d times", subject, id, n)
			}
		}
		if len(counts) != total {
			t.Errorf("%s: %d distinct events in the stream, want one per record, %d", subject, len(counts), total)
		}
	}
	requireOperatorCommandsFindEachDatabase(t, c)

	// The ledger has no table in the orders function's database, and the
	// orders function none in the ledger's: each function is on its own.
	for _, w := range []struct {
		pg    *kfntest.PG
		table string
	}{{c.pg, "ledger_entries"}, {c.ledgerPG, "orders"}} {
		if n := c.countIn(w.pg, `SELECT count(*) FROM pg_tables WHERE tablename = $1`, w.table); n != 0 {
			t.Errorf("database %s holds table %s, which belongs to the other function's database", w.pg.Database, w.table)
		}
	}
}

// revisionMessage is the i-th record of the test: revision i/keys+1 of
// order key i%keys, on partition key%partitions, its amount key*100+revision
// (the per-key sequence number, which the checks read back).
func revisionMessage(i, keys, partitions int) kafka.Message {
	key, revision := i%keys, i/keys+1
	o := orders.Order{
		ID:          fmt.Sprintf("ord-%05d", key),
		Customer:    fmt.Sprintf("cust-%02d", key%13),
		AmountCents: int64(key*100 + revision),
		Currency:    "EUR",
	}
	v, err := json.Marshal(o)
	if err != nil {
		panic(err)
	}
	return kafka.Message{Partition: key % partitions, Key: []byte(o.ID), Value: v}
}

// restartUnderLoad stops the function's Postgres server, keeps it down for
// downtime and starts it again, then waits until each lane of the function
// on it commits again and returns how long each took from the restart.
func restartUnderLoad(t *testing.T, c *chain, function string, server *kfntest.PrivatePostgres, downtime time.Duration) map[string]time.Duration {
	before := laneCursors(t, server.PG, function)
	if len(before) == 0 {
		t.Errorf("%s has claimed no lane on its server before the restart", function)
		return nil
	}
	if err := server.Stop(); err != nil {
		t.Errorf("stop the %s server: %v", function, err)
		return nil
	}
	t.Logf("stopped the %s server (port %d) under load; starting it again in %s", function, server.Port, downtime)
	time.Sleep(downtime)
	if err := server.Start(); err != nil {
		t.Errorf("start the %s server again: %v", function, err)
		return nil
	}
	back := time.Now()
	stalls := map[string]time.Duration{}
	for len(stalls) < len(before) && time.Since(back) < 30*time.Second {
		for lane, cursor := range laneCursors(t, server.PG, function) {
			if _, seen := stalls[lane]; !seen && cursor > before[lane] {
				stalls[lane] = time.Since(back)
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	for lane := range before {
		if _, ok := stalls[lane]; !ok {
			t.Errorf("lane %s of %s did not commit within 30s of its server's restart", lane, function)
		}
	}
	return stalls
}

// laneCursors reads the next offset of each of function's lanes (its
// source's partitions: a function has one source), by "lane N"; none while
// the server does not answer.
func laneCursors(t *testing.T, pg *kfntest.PG, function string) map[string]int64 {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	rows, err := pg.Pool.Query(ctx, `SELECT 'lane ' || partition, next_offset FROM kfn.cursors WHERE consumer = $1`, function)
	if err != nil {
		return nil
	}
	defer rows.Close()
	out := map[string]int64{}
	for rows.Next() {
		var lane string
		var next int64
		if err := rows.Scan(&lane, &next); err != nil {
			return nil
		}
		out[lane] = next
	}
	if rows.Err() != nil {
		return nil
	}
	return out
}

// requireRevisionsInOrder checks both stages per key: the orders row counts
// every revision once and holds the last one; the ledger booked a debit
// and a credit per revision, each revision once, in sequence order, each
// from an event of its own.
func requireRevisionsInOrder(t *testing.T, c *chain, keys, revisions int) {
	t.Helper()
	ctx := context.Background()
	rows, err := c.pg.Pool.Query(ctx, `SELECT order_id, amount_cents, revisions FROM orders`)
	if err != nil {
		t.Fatal(err)
	}
	seen := 0
	for rows.Next() {
		var id string
		var amount int64
		var n int
		if err := rows.Scan(&id, &amount, &n); err != nil {
			t.Fatal(err)
		}
		seen++
		if n != revisions || int(amount%100) != revisions {
			t.Errorf("orders row %s: %d revisions, holding revision %d; want %d, holding the last", id, n, amount%100, revisions)
		}
	}
	rows.Close()
	if seen != keys {
		t.Errorf("orders has %d rows, want one per key (%d)", seen, keys)
	}

	booked := map[string]map[string][]int64{} // side -> order id -> revisions in booking order
	events := map[string]int{}
	rows, err = c.ledgerPG.Pool.Query(ctx, `SELECT side, order_id, amount_cents, event_id FROM ledger_entries ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var side, id, event string
		var amount int64
		if err := rows.Scan(&side, &id, &amount, &event); err != nil {
			t.Fatal(err)
		}
		if booked[side] == nil {
			booked[side] = map[string][]int64{}
		}
		booked[side][id] = append(booked[side][id], amount%100)
		events[event]++
	}
	rows.Close()
	want := make([]int64, revisions)
	for i := range want {
		want[i] = int64(i + 1)
	}
	bad := 0
	for _, side := range []string{ledger.Debit, ledger.Credit} {
		if len(booked[side]) != keys {
			t.Errorf("the ledger has %s entries for %d orders, want %d", side, len(booked[side]), keys)
		}
		for id, got := range booked[side] {
			if !slices.Equal(got, want) && bad < 5 {
				bad++
				t.Errorf("the ledger's %s entries of %s are revisions %v, want %v: each once, in order", side, id, got, want)
			}
		}
	}
	for event, n := range events {
		if n != 2 && bad < 10 {
			bad++
			t.Errorf("event %s booked %d entries, want a debit and a credit", event, n)
		}
	}
	if len(events) != keys*revisions {
		t.Errorf("the ledger booked %d events, want %d", len(events), keys*revisions)
	}
}

// kfnPkg is the kfn command.
const kfnPkg = "github.com/kfn-dev/kfn/cmd/kfn"

// requireOperatorCommandsFindEachDatabase runs kfn verify on both
// functions and kfn status on all, as docs/production/capacity.md shows,
// given DATABASE_URL (the orders function's) and KFN_FUNCTION_DATABASES
// (ledger=the ledger's own): verify must find no violation in either
// stage, and status must show the lanes of both functions, each read from
// its database.
func requireOperatorCommandsFindEachDatabase(t *testing.T, c *chain) {
	t.Helper()
	kfn := kfntest.BuildBinary(t, kfnPkg)
	run := func(args ...string) []byte {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, kfn, args...)
		cmd.Env = append(os.Environ(), "KFN_KAFKA_BROKERS="+strings.Join(c.kafka.Brokers, ","), "KFN_NATS_URL="+c.nats.URL,
			"DATABASE_URL="+c.pg.URL, "KFN_FUNCTION_DATABASES="+ledger.Name+"="+c.ledgerPG.URL)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("kfn %s: %v\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), err, out, stderr.String())
		}
		return out
	}
	for _, v := range []struct{ function, topic, effects string }{
		{orders.Function().Name, c.topic, `SELECT order_id, revisions FROM orders`},
		{ledger.Name, orders.AcceptedSubject, `SELECT event_id FROM ledger_entries WHERE side = 'debit'`},
	} {
		var rep struct {
			OK      bool `json:"ok"`
			Checked struct {
				Records, Events, Effects int64
			} `json:"checked"`
		}
		out := run("verify", "--function", v.function, "--topic", v.topic, "--effects-sql", v.effects, "--json")
		if err := json.Unmarshal(out, &rep); err != nil {
			t.Fatalf("kfn verify --function %s --json: %v\n%s", v.function, err, out)
		}
		t.Logf("kfn verify --function %s, on its database: ok %v, checked %+v", v.function, rep.OK, rep.Checked)
		if !rep.OK || rep.Checked.Effects == 0 {
			t.Errorf("kfn verify --function %s found violations:\n%s", v.function, out)
		}
	}
	var lanes []struct {
		Function string `json:"function"`
		Topic    string `json:"topic"`
	}
	out := run("status", "--json")
	if err := json.Unmarshal(out, &lanes); err != nil {
		t.Fatalf("kfn status --json: %v\n%s", err, out)
	}
	functions := map[string]int{}
	for _, l := range lanes {
		functions[l.Function]++
	}
	if functions[orders.Function().Name] != c.partitions || functions[ledger.Name] < 1 {
		t.Errorf("kfn status over both databases shows lanes %v, want the %d of orders and the ledger's", functions, c.partitions)
	}
}
