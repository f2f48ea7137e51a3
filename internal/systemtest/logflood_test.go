package systemtest_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// A Postgres outage under a loaded worker is logged once per backoff step
// of each kind of failure, not once per lane and retry. The orders worker
// (8 partitions, its relay in the process) reaches Postgres through a
// proxy that goes down for floodOutage while orders keep arriving; every
// line it logs from the stop until it has applied every order again is
// counted.
//
// The bound, from the schedule of internal/repeatlog: a kind of failure
// is logged when it first happens, then after 1 s, 2 s, 4 s … (each step
// twice the last, up to a minute), and once when it is over, so an outage
// of D seconds logs at most 2 + log2(D+1) lines per kind (4 for D = 6 s:
// at 0 s, 1 s and 3 s, and the recovery). On top of that come
// the state changes, each once: the worker becoming unhealthy and
// healthy again, and each lane stopping and being claimed again (a
// constant per lane, not per second). So the lines per outage second stay
// under (kinds × 4 + 2 × lanes + 4) / D; with the 6 kinds a Postgres
// outage touches here (batches, claims, the health probe, readiness, the
// relay's reads and LISTEN, the lease manager), 8 lanes and D = 6 s, that
// is under 8.7 lines a second, against 38 a second when every lane and
// relay shard logged every retry (230 lines in 6 s before repeatlog; an 8 s
// outage once gave one worker 237 identical warnings). Each warning's kind
// is also held to its own schedule over the whole window, recovery
// included.
func TestPostgresOutageIsLoggedOncePerBackoffStep(t *testing.T) {
	const (
		partitions = 8
		outage     = 6 * time.Second
		perKind    = 4 // 2 + log2(6+1), rounded down
		kinds      = 6
	)
	c := newChain(t, partitions)
	u, err := url.Parse(c.pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := kfntest.PostgresProxy(t, u.Host)
	u.Host = proxy.Addr()
	w := c.startOrders("DATABASE_URL=" + u.String())
	w.waitStarted(t)

	// Orders keep arriving before, during and after the outage.
	var produced sync.WaitGroup
	stop := make(chan struct{})
	n := 0
	produced.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(250 * time.Millisecond):
			}
			batch := make([]orders.Order, 40)
			for i := range batch {
				batch[i] = order(n + i)
			}
			c.produce(batch, n)
			n += len(batch)
		}
	})
	waitUntil(t, 30*time.Second, "orders to be applied before the outage", func() (bool, string) {
		got := c.tableCount("orders")
		return got >= 200, fmt.Sprintf("%d orders applied", got)
	})

	down := time.Now()
	proxy.Down()
	time.Sleep(outage)
	if err := proxy.Up(); err != nil {
		t.Fatalf("bring the Postgres proxy up again: %v", err)
	}
	up := time.Now()
	time.Sleep(2 * time.Second)
	close(stop)
	produced.Wait()
	waitUntil(t, 60*time.Second, "every order to be applied after the outage", func() (bool, string) {
		got := c.tableCount("orders")
		return got == int64(n), fmt.Sprintf("%d of %d orders applied", got, n)
	})
	recovered := time.Now()
	requireAlive(t, w)
	t.Logf("Postgres down for %s; every order (%d) applied again %s after it came back", up.Sub(down).Round(time.Millisecond), n, recovered.Sub(up).Round(time.Millisecond))

	byKind := logLinesBetween(t, w.LogFile, down, recovered)
	total := 0
	for _, k := range slices.Sorted(maps.Keys(byKind)) {
		total += byKind[k]
	}
	seconds := up.Sub(down).Seconds()
	bound := float64(kinds*perKind+2*partitions+4) / outage.Seconds()
	var table strings.Builder
	for _, k := range slices.Sorted(maps.Keys(byKind)) {
		fmt.Fprintf(&table, "  %4d  %s\n", byKind[k], k)
	}
	line := fmt.Sprintf("Postgres outage of %.1fs: %d log lines (%.1f per outage second, bound %.1f) from the stop until every order was applied again", seconds, total, float64(total)/seconds, bound)
	t.Logf("%s; by message:\n%s", line, table.String())
	fmt.Println(line)
	if float64(total)/seconds > bound {
		t.Errorf("%.1f log lines per outage second, over the bound of %.1f", float64(total)/seconds, bound)
	}
	// Each kind of repeated failure keeps to its schedule over the window
	// (the outage and the recovery): 2 + log2(window+1) lines.
	window := recovered.Sub(down).Seconds()
	perKindWindow := 2 + int(math.Log2(window+1))
	for k, count := range byKind {
		if !strings.HasPrefix(k, "INFO") && count > perKindWindow {
			t.Errorf("%q logged %d times in %.1fs, over the %d lines of its schedule", k, count, window, perKindWindow)
		}
	}
}

// logLinesBetween counts the JSON log lines of file timed from `from` to
// `to` by level and message, with the count suffix of a repeated line
// ("(repeated 12 times in 4s)") taken off.
func logLinesBetween(t *testing.T, file string, from, to time.Time) map[string]int {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for line := range bytes.Lines(data) {
		var e struct {
			Time  time.Time `json:"time"`
			Level string    `json:"level"`
			Msg   string    `json:"msg"`
		}
		if json.Unmarshal(line, &e) != nil || e.Time.Before(from) || e.Time.After(to) {
			continue
		}
		out[e.Level+" "+repeatedSuffix.ReplaceAllString(e.Msg, "")]++
	}
	return out
}

var repeatedSuffix = regexp.MustCompile(` \(repeated \d+ times? in [^)]*\)$`)
