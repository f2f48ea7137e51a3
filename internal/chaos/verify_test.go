//go:build chaos

package chaos_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"time"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
)

// violationKinds are the keys of kfn verify's "violations", in the table's
// order.
var violationKinds = []string{"lost", "duplicated", "out_of_order", "fenced_but_committed", "unexpected", "unpublished"}

// verdict is what `kfn verify --json` prints (the shared contract).
type verdict struct {
	Function string          `json:"function"`
	Source   string          `json:"source"`
	Cut      json.RawMessage `json:"cut"`
	Checked  struct {
		Records int64 `json:"records"`
		Events  int64 `json:"events"`
		Effects int64 `json:"effects"`
	} `json:"checked"`
	OK         bool `json:"ok"`
	Violations map[string]struct {
		Count    int64    `json:"count"`
		Examples []string `json:"examples"`
	} `json:"violations"`
	Seconds float64 `json:"seconds"`
}

// The functions' effects queries for kfn verify: orders counts how many
// records changed each order (a record's key is its order id); the ledger
// books one debit per event it applied.
const (
	ordersEffects = `SELECT order_id, revisions FROM orders`
	ledgerEffects = `SELECT event_id FROM ledger_entries WHERE side = 'debit'`
)

// verify runs kfn verify on one function against the running deployment:
// orders against its Kafka topic and its events in the stream, the ledger
// against the orders.accepted events in the stream.
func (r *run) verify(function, source, effects string) verdict {
	r.t.Helper()
	args := []string{"verify", "--json", "--examples", "3", "--function", function, "--topic", source, "--effects-sql", effects}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, r.s.kfn, args...)
	cmd.Env = r.s.env("chaos-verify", r.s.dbURL)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !(errors.As(err, &exit) && exit.ExitCode() == 1) {
		r.t.Fatalf("kfn %v: %v\nstdout:\n%s\nstderr:\n%s", args, err, stdout.String(), stderr.String())
	}
	var v verdict
	if err := json.Unmarshal(stdout.Bytes(), &v); err != nil {
		r.t.Fatalf("kfn verify --json printed no JSON object (%v):\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	for _, k := range violationKinds {
		if _, ok := v.Violations[k]; !ok {
			r.t.Fatalf("kfn verify --json has no %q in its violations:\n%s", k, stdout.String())
		}
	}
	if v.OK != (err == nil) {
		r.t.Fatalf("kfn verify exited with %v but says ok=%v:\n%s", err, v.OK, stdout.String())
	}
	return v
}

// counts is one check of the chain: kfn verify's violations by kind, with
// examples, and the records (orders) or events (the ledger) it checked.
type counts struct {
	records    int64
	violations map[string]int64
	examples   []string
}

// countsOf reads a verdict of function's verify into counts, checked
// being what it counts as records.
func countsOf(function string, checked int64, v verdict) counts {
	c := counts{records: checked, violations: map[string]int64{}}
	for _, k := range violationKinds {
		c.violations[k] += v.Violations[k].Count
		for _, e := range v.Violations[k].Examples {
			c.examples = append(c.examples, function+" "+k+": "+e)
		}
	}
	return c
}

// verifyLedger runs kfn verify on the ledger, the chain's NATS-triggered
// function, against every orders.accepted event in the stream below its
// lanes' cursors. It reads the whole subject, so the run calls it on the
// warm-up and the end state; after each fault verifyChain's query checks
// the ledger's bookings.
func (r *run) verifyLedger() counts {
	r.t.Helper()
	v := r.verify(ledger.Name, orders.AcceptedSubject, ledgerEffects)
	return countsOf(ledger.Name, v.Checked.Records, v) // the events below its lanes' cursors
}

// verifyChain runs kfn verify on orders and counts the ledger's orders
// booked more often than orders changed them.
func (r *run) verifyChain() counts {
	r.t.Helper()
	v := r.verify(ordersFn, r.s.topic, ordersEffects)
	c := countsOf(ordersFn, v.Checked.Records, v)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Each orders record that changed an order (its revisions, which kfn
	// verify checks against Kafka: a producer's retry may write an order
	// twice) emits one event, booked as a debit and a credit.
	rows, err := r.s.pool.Query(ctx, `SELECT o.order_id, o.revisions, count(*) FROM orders o JOIN ledger_entries l USING (order_id)
		GROUP BY o.order_id, o.revisions HAVING count(*) > 2 * o.revisions ORDER BY o.order_id`)
	if err != nil {
		r.t.Fatalf("ledger bookings: %v", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		var revisions, n int64
		if err := rows.Scan(&id, &revisions, &n); err != nil {
			r.t.Fatal(err)
		}
		c.violations["duplicated"]++
		c.examples = append(c.examples, fmt.Sprintf("ledger duplicated: order %s (%d revisions) booked in %d entries, want %d", id, revisions, n, 2*revisions))
	}
	if err := rows.Err(); err != nil {
		r.t.Fatal(err)
	}
	return c
}
