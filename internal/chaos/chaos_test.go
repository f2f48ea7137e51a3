//go:build chaos

package chaos_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// takeoverBound is how long a fault may hold a lane: the bound the other
// fault tests hold a killed worker's lanes to (5 lease TTLs: the lease
// expires after one, the new owner claims and reads).
const takeoverBound = 5 * leaseTTL

// run is one chaos run: the deployment, its load, its watcher and its rows.
type run struct {
	t    *testing.T
	s    *stack
	prod *producer
	prog *progress
	nc   *nats.Conn
	js   jetstream.JetStream
	rows []*row
}

// natsConnState describes the run's own NATS connection, for a failure
// message.
func (r *run) natsConnState() string {
	return fmt.Sprintf("%v to %s, %d reconnects, last error %v", r.nc.Status(), r.nc.ConnectedUrlRedacted(), r.nc.Stats().Reconnects, r.nc.LastError())
}

func (r *run) logf(format string, args ...any) {
	r.t.Helper()
	r.t.Logf(format, args...)
}

// TestChaos plays the fault matrix against the orders → ledger chain under
// continuous load, each fault in turn until --duration is over and every
// fault ran at least once, and after each one checks with kfn verify that
// no record was lost, duplicated, reordered or committed by a fenced
// owner, that every lane moved again within takeoverBound, and that the
// chain caught up with what was produced. It prints the table, writes it
// to --json, and fails on any non-zero count or slow takeover.
func TestChaos(t *testing.T) {
	if *intensity <= 0 || *runFor <= 0 {
		t.Fatalf("--intensity (%v) and --duration (%v) must be positive", *intensity, *runFor)
	}
	slot := time.Duration(float64(time.Minute) / *intensity)
	matrix, err := selectFaults(*only)
	if err != nil {
		t.Fatal(err)
	}
	s := newStack(t)
	t.Logf("chaos: %s; Kafka: %s; every %s one fault, for %s; lease TTL %s, takeover bound %s",
		s, s.kafka.description, slot, *runFor, leaseTTL, takeoverBound)
	s.startAll()

	nc, err := nats.Connect(s.natsURL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	r := &run{t: t, s: s, prod: newProducer(t, s.kafka.brokers, s.topic), prog: newProgress(s.pool), nc: nc, js: js}
	for _, f := range matrix {
		r.rows = append(r.rows, &row{Fault: f.name})
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stopProgress := kfntest.Background(t, "the cursor watcher", r.prog.run)
	defer stopProgress()
	loadDone := make(chan struct{})
	go func() { defer close(loadDone); r.prod.run(ctx) }()

	// Warm up: every lane flows before the first fault.
	waitUntil(t, 60*time.Second, "every lane to flow", func() (bool, string) {
		s.requireRunning(s.running()...)
		_, still := r.prog.takeovers(hit{at: time.Now().Add(-2 * time.Second), lanes: r.prog.owned(nil)}, time.Now())
		n := r.prog.lanes()
		return n == partitions+ledgerLanes && len(still) == 0, fmt.Sprintf("%d lanes seen, still: %s", n, laneList(still))
	})
	before := r.verifyChain()
	r.requireClean("the warm-up", before)
	r.requireClean("the ledger's warm-up", r.verifyLedger())

	start := time.Now()
	for i := 0; time.Since(start) < *runFor || i < len(matrix); i++ {
		f, rw := matrix[i%len(matrix)], r.rows[i%len(matrix)]
		if f.skipped != nil {
			if why := f.skipped(r); why != "" {
				rw.Skipped = why
				continue
			}
		}
		slotEnd := time.Now().Add(slot)
		before = r.inject(f, rw, before)
		time.Sleep(time.Until(slotEnd))
	}

	cancel()
	<-loadDone
	acked, failed, poisoned, lastErr := r.prod.stats()
	t.Logf("load: %d orders acked, %d writes failed (last: %v), %d poison records", acked, failed, lastErr, poisoned)
	n, ackedBelow := r.prod.mark()
	waitUntil(t, 2*time.Minute, "the chain to drain", func() (bool, string) {
		return r.caughtUp(n, ackedBelow)
	})
	s.requireRunning(s.running()...)
	final := r.verifyChain()
	r.requireClean("the end state", final)
	finalLedger := r.verifyLedger()
	r.requireClean("the ledger's end state", finalLedger)
	r.report(final, finalLedger)
}

// inject plays one fault and fills its row: takeovers, time to catch up,
// and the change in kfn verify's counts.
func (r *run) inject(f fault, rw *row, before counts) counts {
	t := r.t
	t.Helper()
	rw.Injections++
	t.Logf("--- %s (#%d)", f.name, rw.Injections)
	tl := r.watchTimeline()
	h := f.inject(r, rw.Injections-1)
	healed := time.Now()
	n, acked := r.prod.mark()
	tl.healedAt(healed, n, acked)

	// Every lane the fault hit must flow again, and within the bound.
	var took map[lane]time.Duration
	waitUntil(t, takeoverBound+30*time.Second, "every lane to flow again after "+f.name, func() (bool, string) {
		var still []lane
		took, still = r.prog.takeovers(h, healed)
		return len(still) == 0, "standing still: " + laneList(still)
	})
	var worst time.Duration
	var worstLane lane
	for l, d := range took {
		rw.takeovers = append(rw.takeovers, d)
		if d > worst {
			worst, worstLane = d, l
		}
	}
	if worst > takeoverBound {
		t.Errorf("%s: lane %s stood still %s, more than the bound of %s (5 × the lease TTL)", f.name, worstLane, worst.Round(time.Millisecond), takeoverBound)
	}

	// The chain catches up with everything produced before the heal.
	if !kfntest.Await(t, 2*time.Minute, "the chain to catch up after "+f.name, func() (bool, string) { return r.caughtUp(n, acked) }) {
		t.Fatalf("the chain did not catch up after %s: %s", f.name, r.whereAreTheMissing(n))
	}
	rw.recoveries = append(rw.recoveries, time.Since(healed))
	t.Logf("%s: %s", f.name, tl.end(healed, time.Now()))
	r.s.requireRunning(r.s.running()...)

	after := r.verifyChain()
	rw.Records += after.records - before.records
	for k, c := range after.violations {
		if d := c - before.violations[k]; d > 0 {
			rw.add(k, d)
		}
	}
	t.Logf("%s: worst takeover %s (lane %s), caught up %s after the heal, verify: %v",
		f.name, worst.Round(time.Millisecond), worstLane, rw.recoveries[len(rw.recoveries)-1].Round(time.Millisecond), after.violations)
	r.requireClean("after "+f.name, after)
	return after
}

// requireClean fails the test when a verify pass found a violation.
func (r *run) requireClean(when string, c counts) {
	r.t.Helper()
	for _, k := range violationKinds {
		if c.violations[k] != 0 {
			r.t.Errorf("kfn verify %s: %d %s; examples: %v", when, c.violations[k], k, c.examples)
		}
	}
}

// clean says whether a check found no violation.
func clean(c counts) bool {
	return !slices.ContainsFunc(violationKinds, func(k string) bool { return c.violations[k] != 0 })
}

// verdictWord says how the end state's checks came out.
func verdictWord(checks ...counts) string {
	for _, c := range checks {
		if !clean(c) {
			return "VIOLATIONS (see above)"
		}
	}
	return "no violation"
}

// report prints the table and writes it to --json.
func (r *run) report(final, finalLedger counts) {
	r.t.Helper()
	for _, rw := range r.rows {
		rw.finish()
	}
	table := renderTable(r.rows)
	fmt.Printf("\n=== chaos table (Kafka: %s; lease TTL %s; takeover bound %s)\n%s\n", r.s.kafka.description, leaseTTL, takeoverBound, table)
	fmt.Printf("end state, kfn verify: orders %d records, ledger %d events, %s\n", final.records, finalLedger.records, verdictWord(final, finalLedger))
	if *jsonOut == "" {
		return
	}
	out := struct {
		Kafka         string  `json:"kafka"`
		Duration      string  `json:"duration"`
		Intensity     float64 `json:"intensity_per_minute"`
		LeaseTTLMs    int64   `json:"lease_ttl_ms"`
		BoundMs       int64   `json:"takeover_bound_ms"`
		FinalRecords  int64   `json:"final_records"`
		FinalEvents   int64   `json:"final_ledger_events"`
		Rows          []*row  `json:"rows"`
		FinalVerified bool    `json:"final_verified_ok"`
	}{r.s.kafka.description, runFor.String(), *intensity, leaseTTL.Milliseconds(), takeoverBound.Milliseconds(), final.records, finalLedger.records, r.rows, clean(final) && clean(finalLedger)}
	data, err := json.MarshalIndent(out, "", "  ")
	if err != nil {
		r.t.Fatal(err)
	}
	if err := os.WriteFile(*jsonOut, append(data, '\n'), 0o644); err != nil {
		r.t.Fatalf("--json %s: %v", *jsonOut, err)
	}
}
