package main

import (
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestDevRunsTheChainWithEachFunctionOnItsOwnDatabase runs the command
// docs/production/capacity.md shows, for a bounded time: kfn dev
// --databases 2 starts a second throwaway cluster for the ledger, runs
// orders → ledger joined only by NATS, prints the export line that tells
// the operator commands where the ledger's database is, and checks at the
// end that the ledger booked every valid order once, in its own database.
func TestDevRunsTheChainWithEachFunctionOnItsOwnDatabase(t *testing.T) {
	code, out, stderr := kfn(t, "dev", "--databases", "2", "--duration", "8s", "--rate", "200")
	if code != 0 {
		t.Fatalf("kfn dev --databases 2: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, stderr)
	}
	for _, want := range []string{
		"postgres  throwaway cluster at ",
		"postgres  throwaway cluster of ledger's own at ",
		"export KFN_FUNCTION_DATABASES='ledger=postgres://",
		"kfn dev: verify: OK, every record applied exactly once or dead-lettered",
		"kfn dev: verify: OK, the ledger booked every valid order exactly once, on its own database",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("kfn dev --databases 2 output lacks %q:\n%s", want, out)
		}
	}
	booked := regexp.MustCompile(`ledger booked +(\d+)`).FindAllStringSubmatch(out, -1)
	if len(booked) == 0 {
		t.Fatalf("no progress line shows the ledger's bookings:\n%s", out)
	}
	if n, _ := strconv.Atoi(booked[len(booked)-1][1]); n < 500 {
		t.Errorf("the ledger booked %d orders in 8s at 200/s, want most of them", n)
	}
}

func TestDevRefusesADatabaseCountItCannotRun(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"dev", "--databases", "3"}, "kfn dev: --databases 3: 1 (orders) or 2 (orders and ledger, each on its own Postgres)"},
		{[]string{"dev", "--databases", "2", "./cmd/payments"}, "kfn dev: --databases 2 runs the demo chain"},
	} {
		code, _, stderr := kfn(t, c.args...)
		if code != 2 || !strings.HasPrefix(stderr, c.want) {
			t.Errorf("kfn %s: exit %d, %q; want exit 2 and %q", strings.Join(c.args, " "), code, stderr, c.want)
		}
	}
}
