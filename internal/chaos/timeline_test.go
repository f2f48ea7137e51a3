//go:build chaos

package chaos_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kfn-dev/kfn/runtime"
)

// timeline records, while one fault plays and the chain recovers from it,
// when each stage of the chain last stood still and moved again: the event
// stream's last sequence (the relays' publishes stored), the orders the
// orders function applied and the orders the ledger booked, plus the
// stream leader elections NATS announced. It shows where a recovery's time
// goes.
type timeline struct {
	r      *run
	start  time.Time
	stop   chan struct{}
	done   chan struct{}
	sub    *nats.Subscription
	mu     sync.Mutex
	series []*stall
	leader []string // "<stream> +<since start>", in order
	healed time.Time
	n      int
	acked  int
	behind []string // after the heal, each second: where the missing orders are
}

// healedAt marks the heal: from then the timeline notes each second where
// the first n orders (acked of them acked by Kafka) are while the chain
// has not caught up.
func (tl *timeline) healedAt(healed time.Time, n, acked int) {
	tl.mu.Lock()
	tl.healed, tl.n, tl.acked = healed, n, acked
	tl.mu.Unlock()
}

// stall is one watched count and the longest time it stood still.
type stall struct {
	name        string
	value       int64
	movedAt     time.Time // the last change
	longestFrom time.Time
	longestTo   time.Time
}

func (s *stall) observe(v int64, at time.Time) {
	if v == s.value {
		return
	}
	if !s.movedAt.IsZero() && at.Sub(s.movedAt) > s.longestTo.Sub(s.longestFrom) {
		s.longestFrom, s.longestTo = s.movedAt, at
	}
	s.value, s.movedAt = v, at
}

// watchTimeline starts a timeline at the fault's start.
func (r *run) watchTimeline() *timeline {
	tl := &timeline{r: r, start: time.Now(), stop: make(chan struct{}), done: make(chan struct{}),
		series: []*stall{{name: "stream seq"}, {name: "orders applied"}, {name: "ledger booked"}}}
	sub, err := r.nc.Subscribe("$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.>", func(m *nats.Msg) {
		var adv struct {
			Stream string `json:"stream"`
			Leader string `json:"leader"`
		}
		_ = json.Unmarshal(m.Data, &adv)
		tl.mu.Lock()
		tl.leader = append(tl.leader, fmt.Sprintf("%s→%s +%s", adv.Stream, adv.Leader, time.Since(tl.start).Round(time.Millisecond)))
		tl.mu.Unlock()
	})
	if err == nil {
		tl.sub = sub
	}
	go tl.poll()
	return tl
}

func (tl *timeline) poll() {
	defer close(tl.done)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-tl.stop:
			return
		case <-tick.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		now := time.Now()
		if st, err := tl.r.js.Stream(ctx, runtime.DefaultStream); err == nil {
			tl.mu.Lock()
			tl.series[0].observe(int64(st.CachedInfo().State.LastSeq), now)
			tl.mu.Unlock()
		}
		var applied, booked int64
		if err := tl.r.s.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM ledger_entries)`).Scan(&applied, &booked); err == nil {
			tl.mu.Lock()
			tl.series[1].observe(applied, now)
			tl.series[2].observe(booked, now)
			tl.mu.Unlock()
		}
		tl.mu.Lock()
		healed, n, acked, notes := tl.healed, tl.n, tl.acked, len(tl.behind)
		tl.mu.Unlock()
		if !healed.IsZero() && now.Sub(healed) >= time.Duration(notes)*time.Second {
			if ok, why := tl.r.caughtUp(n, acked); !ok {
				tl.mu.Lock()
				tl.behind = append(tl.behind, fmt.Sprintf("heal+%s: %s", now.Sub(healed).Round(100*time.Millisecond), why))
				tl.mu.Unlock()
			}
		}
		cancel()
	}
}

// end stops the timeline and describes it relative to the fault's start,
// with healed and caught up marked.
func (tl *timeline) end(healed, caughtUp time.Time) string {
	close(tl.stop)
	<-tl.done
	if tl.sub != nil {
		_ = tl.sub.Unsubscribe()
	}
	rel := func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return "+" + t.Sub(tl.start).Round(time.Millisecond).String()
	}
	tl.mu.Lock()
	defer tl.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "timeline: healed %s, caught up %s", rel(healed), rel(caughtUp))
	for _, s := range tl.series {
		fmt.Fprintf(&b, "; %s stood still %s..%s", s.name, rel(s.longestFrom), rel(s.longestTo))
	}
	fmt.Fprintf(&b, "; leaders elected: %s", strings.Join(tl.leader, ", "))
	for _, w := range tl.behind {
		fmt.Fprintf(&b, "\n\t%s", w)
	}
	return b.String()
}
