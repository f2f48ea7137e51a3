//go:build chaos

package chaos_test

import (
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// row is one fault's line of the table.
type row struct {
	Fault      string `json:"fault"`
	Skipped    string `json:"skipped,omitempty"`
	Injections int    `json:"injections"`
	// Records is how many more Kafka records kfn verify checked after the
	// fault's windows than before them.
	Records            int64 `json:"records"`
	Lost               int64 `json:"lost"`
	Duplicated         int64 `json:"duplicated"`
	OutOfOrder         int64 `json:"out_of_order"`
	FencedButCommitted int64 `json:"fenced_but_committed"`
	Unexpected         int64 `json:"unexpected"`
	Unpublished        int64 `json:"unpublished"`
	// Takeover is, over every lane and injection, the time from the fault
	// (or its heal, when nothing could move before) to the lane's cursor
	// moving again; Recover is the longest time from the heal until the
	// ledger had booked every order acked before it.
	TakeoverP50Ms int64 `json:"takeover_p50_ms"`
	TakeoverP99Ms int64 `json:"takeover_p99_ms"`
	RecoverMaxMs  int64 `json:"recover_max_ms"`

	takeovers  []time.Duration
	recoveries []time.Duration
}

// add counts n violations of kfn verify's kind.
func (rw *row) add(kind string, n int64) {
	*map[string]*int64{
		"lost": &rw.Lost, "duplicated": &rw.Duplicated, "out_of_order": &rw.OutOfOrder,
		"fenced_but_committed": &rw.FencedButCommitted, "unexpected": &rw.Unexpected, "unpublished": &rw.Unpublished,
	}[kind] += n
}

// finish computes the row's figures from its measurements.
func (rw *row) finish() {
	rw.TakeoverP50Ms = percentile(rw.takeovers, 50).Milliseconds()
	rw.TakeoverP99Ms = percentile(rw.takeovers, 99).Milliseconds()
	if len(rw.recoveries) > 0 {
		rw.RecoverMaxMs = slices.Max(rw.recoveries).Milliseconds()
	}
}

// percentile is the nearest-rank percentile of ds, 0 for none.
func percentile(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(ds))
	i := (len(s)*p + 99) / 100
	return s[max(0, i-1)]
}

// renderTable is the table as docs/guarantees.md shows it (Markdown).
func renderTable(rows []*row) string {
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 1, ' ', tabwriter.Debug)
	fmt.Fprintln(w, "| fault\t injections\t records\t lost\t duplicated\t out-of-order\t fenced-but-committed\t unexpected\t unpublished\t takeover p50\t takeover p99\t recover to zero lag\t")
	fmt.Fprintln(w, "|---\t---\t---\t---\t---\t---\t---\t---\t---\t---\t---\t---\t")
	for _, rw := range rows {
		if rw.Skipped != "" {
			fmt.Fprintf(w, "| %s\t %s\t\t\t\t\t\t\t\t\t\t\t\n", rw.Fault, rw.Skipped)
			continue
		}
		fmt.Fprintf(w, "| %s\t %d\t %d\t %d\t %d\t %d\t %d\t %d\t %d\t %s\t %s\t %s\t\n", rw.Fault, rw.Injections, rw.Records,
			rw.Lost, rw.Duplicated, rw.OutOfOrder, rw.FencedButCommitted, rw.Unexpected, rw.Unpublished,
			ms(rw.TakeoverP50Ms), ms(rw.TakeoverP99Ms), ms(rw.RecoverMaxMs))
	}
	w.Flush()
	return b.String()
}

func ms(n int64) string { return (time.Duration(n) * time.Millisecond).String() }
