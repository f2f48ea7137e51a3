//go:build chaos

package chaos_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
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

// verify runs kfn verify on one function of the chain against the running
// deployment.
func (r *run) verify(function string) verdict {
	r.t.Helper()
	args := []string{"verify", "--json", "--examples", "3", "--function", function}
	switch function {
	case ordersFn:
		args = append(args, "--topic", r.s.topic, "--effects-sql", ordersEffects)
	case ledger.Name:
		args = append(args, "--topic", orders.AcceptedSubject, "--effects-sql", ledgerEffects)
	}
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

// counts is one verify pass over the chain: violations by kind, summed
// over both functions, and the orders records checked.
type counts struct {
	records    int64
	violations map[string]int64
	examples   []string
}

func (r *run) verifyChain() counts {
	c := counts{violations: map[string]int64{}}
	for _, fn := range []string{ordersFn, ledger.Name} {
		v := r.verify(fn)
		if fn == ordersFn {
			c.records = v.Checked.Records
		}
		for _, k := range violationKinds {
			c.violations[k] += v.Violations[k].Count
			for _, e := range v.Violations[k].Examples {
				c.examples = append(c.examples, fn+" "+k+": "+e)
			}
		}
	}
	return c
}

// The effects queries: one row per applied source record.
const (
	ordersEffects = `SELECT 1`
	ledgerEffects = `SELECT 1`
)
