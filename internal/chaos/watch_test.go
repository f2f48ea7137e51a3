//go:build chaos

package chaos_test

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// lane is one cursor row: a Kafka partition of orders, or a subject lane
// of the ledger.
type lane struct {
	consumer, topic string
	partition       int
}

func (l lane) String() string { return fmt.Sprintf("%s/%s[%d]", l.consumer, l.topic, l.partition) }

// progress watches kfn.cursors and remembers when each lane's cursor moved
// forward: a lane's records flow when its cursor moves. It is how the run
// measures a takeover: from a fault to each lane's next forward move.
type progress struct {
	pool *pgxpool.Pool

	mu    sync.Mutex
	last  map[lane]int64
	owner map[lane]string      // the worker that claimed it last
	moved map[lane][]move // each forward move seen, in order
}

// move is a lane's cursor seen further forward than before, at when, with
// the owner that moved it.
type move struct {
	at    time.Time
	owner string
}

const pollEvery = 50 * time.Millisecond

func newProgress(pool *pgxpool.Pool) *progress {
	return &progress{pool: pool, last: map[lane]int64{}, owner: map[lane]string{}, moved: map[lane][]move{}}
}

// run polls until ctx ends; polls that fail (Postgres restarting) are
// skipped.
func (p *progress) run(ctx context.Context) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(pollEvery):
		}
		p.poll(ctx)
	}
}

func (p *progress) poll(ctx context.Context) {
	qctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	rows, err := p.pool.Query(qctx, `SELECT consumer, topic, partition, next_offset, owner FROM kfn.cursors`)
	if err != nil {
		return
	}
	defer rows.Close()
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	for rows.Next() {
		var l lane
		var next int64
		var owner string
		if rows.Scan(&l.consumer, &l.topic, &l.partition, &next, &owner) != nil {
			return
		}
		p.owner[l] = owner
		if prev, ok := p.last[l]; ok && next > prev {
			p.moved[l] = append(p.moved[l], move{now, owner})
		}
		p.last[l] = next
	}
}

// owned returns the lanes whose last seen owner is one of workers, or
// every lane when workers is empty.
func (p *progress) owned(workers []string) []lane {
	p.mu.Lock()
	defer p.mu.Unlock()
	var ls []lane
	for l, o := range p.owner {
		if len(workers) == 0 || slices.Contains(workers, o) {
			ls = append(ls, l)
		}
	}
	return ls
}

// takeovers returns, for each of h's lanes, how long after h.at its
// cursor first moved forward by an owner other than h.from, and the lanes
// that have not moved so since.
func (p *progress) takeovers(h hit) (map[lane]time.Duration, []lane) {
	p.mu.Lock()
	defer p.mu.Unlock()
	got := map[lane]time.Duration{}
	var still []lane
	for _, l := range h.lanes {
		ms := p.moved[l]
		i := sort.Search(len(ms), func(i int) bool { return ms[i].at.After(h.at) })
		for i < len(ms) && slices.Contains(h.from, ms[i].owner) {
			i++
		}
		if i == len(ms) {
			still = append(still, l)
			continue
		}
		got[l] = ms[i].at.Sub(h.at)
	}
	sort.Slice(still, func(i, j int) bool { return still[i].String() < still[j].String() })
	return got, still
}

// lanes is how many lanes the watcher has seen.
func (p *progress) lanes() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.last)
}

func laneList(ls []lane) string {
	s := make([]string, len(ls))
	for i, l := range ls {
		s[i] = l.String()
	}
	return strings.Join(s, ", ")
}

// caughtUp reports whether the chain has caught up with the first n
// orders, acked of which were acked by Kafka: the ledger has booked at
// least that many of them (each booked order has its debit and credit).
func caughtUp(ctx context.Context, pool *pgxpool.Pool, n, acked int) (bool, string) {
	qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var booked int
	err := pool.QueryRow(qctx, `SELECT count(DISTINCT order_id) FROM ledger_entries WHERE order_id < $1`, orderID(n)).Scan(&booked)
	if err != nil {
		return false, err.Error()
	}
	return booked >= acked, fmt.Sprintf("the ledger booked %d of the %d acked orders below %s", booked, acked, orderID(n))
}
