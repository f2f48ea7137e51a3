//go:build chaos

package chaos_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/internal/naming"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
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
	owner map[lane]string // the worker that claimed it last
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
// cursor first moved forward by an owner other than h.from (or by anyone
// after healed: a paused or cut-off worker that is back may own its lanes
// again), and the lanes that have not moved so since.
func (p *progress) takeovers(h hit, healed time.Time) (map[lane]time.Duration, []lane) {
	p.mu.Lock()
	defer p.mu.Unlock()
	got := map[lane]time.Duration{}
	var still []lane
	for _, l := range h.lanes {
		ms := p.moved[l]
		i := sort.Search(len(ms), func(i int) bool { return ms[i].at.After(h.at) })
		for i < len(ms) && !ms[i].at.After(healed) && slices.Contains(h.from, ms[i].owner) {
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
// Its reason says where the others are: not yet applied by orders, in the
// outbox, or on their way through the stream.
func (r *run) caughtUp(n, acked int) (bool, string) {
	qctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var applied, booked, outbox int
	var oldest *time.Duration
	err := r.s.pool.QueryRow(qctx, `SELECT
	(SELECT count(*) FROM orders WHERE order_id < $1),
	(SELECT count(DISTINCT order_id) FROM ledger_entries WHERE order_id < $1),
	(SELECT count(*) FROM kfn.outbox),
	(SELECT now() - min(created_at) FROM kfn.outbox)`, orderID(n)).Scan(&applied, &booked, &outbox, &oldest)
	if err != nil {
		return false, err.Error()
	}
	age := "none"
	if oldest != nil {
		age = oldest.Round(time.Millisecond).String()
	}
	if booked >= acked {
		return true, ""
	}
	consumer := r.streamState(qctx)
	return false, fmt.Sprintf("of the %d acked orders below %s, orders applied %d and the ledger booked %d; the outbox holds %d rows, the oldest %s old; %s",
		acked, orderID(n), applied, booked, outbox, age, consumer)
}

// streamState describes the event stream's orders.accepted events and the
// ledger's lane consumers, for a chain that does not catch up.
func (r *run) streamState(ctx context.Context) string {
	var b strings.Builder
	if st, err := r.js.Stream(ctx, runtime.DefaultStream); err != nil {
		fmt.Fprintf(&b, "stream: %v", err)
	} else if info, err := st.Info(ctx, jetstream.WithSubjectFilter(orders.AcceptedSubject)); err != nil {
		fmt.Fprintf(&b, "stream: %v", err)
	} else {
		fmt.Fprintf(&b, "stream: %d %s events, %d replicas, last seq %d", info.State.Subjects[orders.AcceptedSubject], orders.AcceptedSubject, info.Config.Replicas, info.State.LastSeq)
	}
	for l := range ledgerLanes {
		name := naming.LaneConsumer(ledger.Name, l, ledgerLanes)
		fmt.Fprintf(&b, "; %s: ", name)
		if c, err := r.js.Consumer(ctx, runtime.DefaultStream, name); err != nil {
			b.WriteString(err.Error())
		} else if ci, err := c.Info(ctx); err != nil {
			b.WriteString(err.Error())
		} else {
			fmt.Fprintf(&b, "ack floor %d, delivered %d, %d pending, %d awaiting ack, %d redelivered", ci.AckFloor.Stream, ci.Delivered.Stream, ci.NumPending, ci.NumAckPending, ci.NumRedelivered)
		}
	}
	return b.String()
}

// whereAreTheMissing finds up to 5 orders below the n-th that orders
// applied and the ledger did not book, and looks for their
// orders.accepted events in the stream.
func (r *run) whereAreTheMissing(n int) string {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rows, err := r.s.pool.Query(ctx, `SELECT o.order_id FROM orders o WHERE o.order_id < $1
		AND NOT EXISTS (SELECT 1 FROM ledger_entries l WHERE l.order_id = o.order_id) ORDER BY 1 LIMIT 5`, orderID(n))
	if err != nil {
		return err.Error()
	}
	missing, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err.Error()
	}
	found := map[string][]string{}
	cons, err := r.js.OrderedConsumer(ctx, runtime.DefaultStream, jetstream.OrderedConsumerConfig{FilterSubjects: []string{orders.AcceptedSubject}})
	if err != nil {
		return fmt.Sprintf("missing %v; ordered consumer: %v", missing, err)
	}
	for {
		batch, err := cons.Fetch(500, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			break
		}
		got := 0
		for m := range batch.Messages() {
			got++
			var o orders.Order
			if json.Unmarshal(m.Data(), &o) == nil && slices.Contains(missing, o.ID) {
				meta, _ := m.Metadata()
				found[o.ID] = append(found[o.ID], fmt.Sprintf("seq %d id %s lane %d", meta.Sequence.Stream, m.Headers().Get(jetstream.MsgIDHeader), outbox.LaneOf([]byte(o.ID), ledgerLanes)))
			}
		}
		if got == 0 || batch.Error() != nil {
			break
		}
	}
	var b strings.Builder
	for _, id := range missing {
		fmt.Fprintf(&b, "order %s applied by orders, not booked by the ledger; in the stream: %v; ", id, found[id])
	}
	return b.String() + r.streamState(ctx)
}
