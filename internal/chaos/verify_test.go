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

// ordersEffects is the orders function's effects query for kfn verify:
// how many records changed each order (a record's key is its order id).
const ordersEffects = `SELECT order_id, revisions FROM orders`

// verify runs kfn verify on the orders function against the running
// deployment, with its events in the stream.
func (r *run) verify() verdict {
	r.t.Helper()
	args := []string{"verify", "--json", "--examples", "3", "--function", ordersFn, "--topic", r.s.topic, "--effects-sql", ordersEffects}
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

// counts is one check of the chain: kfn verify's violations of orders by
// kind, plus the ledger's duplicated bookings, and the records checked.
type counts struct {
	records    int64
	violations map[string]int64
	examples   []string
}

// verifyChain runs kfn verify on orders and counts the ledger's orders
// booked more often than orders changed them.
func (r *run) verifyChain() counts {
	r.t.Helper()
	c := counts{violations: map[string]int64{}}
	v := r.verify()
	c.records = v.Checked.Records
	for _, k := range violationKinds {
		c.violations[k] += v.Violations[k].Count
		for _, e := range v.Violations[k].Examples {
			c.examples = append(c.examples, "orders "+k+": "+e)
		}
	}
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
