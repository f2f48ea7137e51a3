package lease

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

// logLines reads the JSON log lines written to file so far.
func logLines(t *testing.T, file string) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var out []map[string]any
	for line := range bytes.Lines(data) {
		var e map[string]any
		if err := json.Unmarshal(line, &e); err != nil {
			t.Fatalf("log line is not JSON: %v: %s", err, line)
		}
		out = append(out, e)
	}
	return out
}

// heldCounts checks a member's Info lines: none per item, and each "leases
// held" line with its count and items. It returns the counts in order.
func heldCounts(t *testing.T, file string) []int {
	t.Helper()
	var held []int
	for _, e := range logLines(t, file) {
		msg, _ := e["msg"].(string)
		if slices.Contains([]string{"claimed", "released", "stopping claim", "claim ended; lease not released"}, msg) {
			t.Errorf("per-item line %q logged at %v, want Debug only", msg, e["level"])
		}
		if msg != "leases held" {
			continue
		}
		n, ok := e["held"].(float64)
		if list, isList := e["items"].([]any); !ok || !isList || len(list) != int(n) {
			t.Errorf("leases held line with held %v and items %v: want the count and the list", e["held"], e["items"])
		}
		held = append(held, int(n))
	}
	return held
}

// At Info, a member logs its held leases once per change of the set (a
// "leases held" line with the count and the items, once the set has
// settled), never a line per item's acquire, renewal or release; those
// are Debug.
func TestManagerLogsItsHeldLeasesOncePerChange(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tr := newTracker()
	defer tr.check(t)
	items := &itemList{}
	items.set(names("orders/", 6))

	logA := filepath.Join(t.TempDir(), "a.log")
	f, err := os.Create(logA)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cfgA := testManagerConfig("A")
	cfgA.Logger = slog.New(slog.NewJSONHandler(f, &slog.HandlerOptions{Level: slog.LevelInfo}))
	stopA := runMember(t, newManager(t, connect(t, b.nats.URL), cfgA), items, tr)
	waitFor(t, livenessBound, "A to own all 6 items", func() bool { return len(tr.owners()) == 6 })
	time.Sleep(3 * testRenew) // renewals, which log nothing at Info
	stopB := runMember(t, newManager(t, connect(t, b.nats.URL), testManagerConfig("B")), items, tr)
	wantB := 0
	for _, owner := range Assign([]string{"A", "B"}, names("orders/", 6)) {
		if owner == "B" {
			wantB++
		}
	}
	waitFor(t, livenessBound, "B to take its share", func() bool {
		n := 0
		for _, owner := range tr.owners() {
			if owner == "B" {
				n++
			}
		}
		return n == wantB
	})
	// The line comes once the set has settled, RenewEvery after the change.
	waitFor(t, livenessBound, "A to log its smaller set", func() bool { return slices.Contains(heldCounts(t, logA), 6-wantB) })
	stopA()
	stopB()

	held := heldCounts(t, logA)
	t.Logf("A's leases held lines: %v", held)
	if len(held) < 3 || held[len(held)-1] != 0 || !slices.Contains(held, 6) || !slices.Contains(held, 6-wantB) {
		t.Errorf("A logged the held counts %v; want them to reach 6, then %d after B joined, and end at 0", held, 6-wantB)
	}
	for i := 1; i < len(held); i++ {
		if held[i] == held[i-1] {
			t.Errorf("A logged %d held leases twice in a row (%v): a line without a change", held[i], held)
		}
	}
}

// TestShutdownPhasesStartNoLaterThanAnyClaimSawTheStop: Run notes the end
// of its ctx in a goroutine that can run after a claim's work returned; the
// phases are timed from the earliest stop any claim saw, so none is
// negative.
func TestShutdownPhasesStartNoLaterThanAnyClaimSawTheStop(t *testing.T) {
	base := time.Now()
	at := func(us int) time.Time { return base.Add(time.Duration(us) * time.Microsecond) }
	p := shutdownPhases{stopAsked: at(100)} // noted late
	p.note(claimEnd{item: "0", stopAsked: at(10), workReturned: at(30), released: at(200)})
	p.note(claimEnd{item: "1", stopAsked: at(40), workReturned: at(80), released: at(150)})
	attrs := p.attrs()
	want := []any{"claims", 2, "released", 2, "work_returned_after", 70 * time.Microsecond, "slowest_item", "1", "released_after", 190 * time.Microsecond}
	if fmt.Sprint(attrs) != fmt.Sprint(want) {
		t.Errorf("attrs %v, want %v", attrs, want)
	}
}
