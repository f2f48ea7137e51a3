package observe

import (
	"context"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
)

// Metrics an on-call engineer alerts on (issue 12), beside the counters of
// metrics.go: the outbox backlog, stalled lanes, leases held and the relay's
// commit-to-ack latency histogram.

// deadLetterReasons are the reasons a record is dead-lettered with; each
// function exposes a series for every one, zero until it happens.
var deadLetterReasons = []string{"panic", "timeout", "data_error", "permanent", "handler_error", "oversized", "key_parked"}

// outboxSampleEvery is how long an outbox sample serves scrapes; the query
// runs at most this often, and with outboxSampleTimeout.
const (
	outboxSampleEvery   = 5 * time.Second
	outboxSampleTimeout = time.Second
	// outboxExactCount is how many outbox rows are counted exactly; above
	// it, the backlog is the planner's estimate (pg_class.reltuples) if that
	// is larger.
	outboxExactCount = 100_000
	// walReaderSilent is how long the WAL slot's reader may go without a
	// report before the slot counts as unread.
	walReaderSilent = 30 * time.Second
)

type opsMetrics struct {
	src                                   Sources
	outboxBacklog, outboxAge              *prometheus.Desc
	stalled, leases, ackLatency, sinceCmt *prometheus.Desc
	walHeld, walPending, walAge, walLost  *prometheus.Desc

	mu        sync.Mutex
	sampledAt time.Time
	sampled   bool
	backlog   float64
	oldestAge float64
	wal       outbox.WALState // sampled with the backlog; zero when not set up
}

func newOpsMetrics(src Sources) *opsMetrics {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("kfn_"+name, help, labels, prometheus.Labels{"worker": src.WorkerID})
	}
	return &opsMetrics{
		src:           src,
		outboxBacklog: d("outbox_backlog", "Rows in kfn.outbox not yet relayed: counted exactly up to 100000, above that the planner's estimate; sampled at most every 5 s."),
		outboxAge:     d("outbox_oldest_age_seconds", "Age of the oldest row in kfn.outbox (0 when empty); sampled at most every 5 s."),
		stalled:       d("lanes_stalled", "Owned lanes with lag > 0 and no commit for longer than --stall-after.", "function"),
		leases:        d("leases_held", "Lanes (partitions or subjects) this worker holds a lease on.", "function"),
		sinceCmt:      d("partition_seconds_since_commit", "Seconds since the lane's last commit (or its claim, before the first).", "function", "source", "partition"),
		ackLatency:    d("outbox_ack_latency_seconds", "Time from an outbox event's commit (its created_at) to the stream's ack."),
		walHeld:       d("wal_slot_held_bytes", "WAL the WAL outbox's replication slot holds back: from its confirmed position to the server's current one (only when the WAL outbox is set up); sampled at most every 5 s."),
		walPending:    d("wal_slot_pending_events", "Events the slot's reader has read and the stream has not acked yet, as the reader last reported (events not read yet are not counted)."),
		walAge:        d("wal_slot_oldest_pending_age_seconds", "Age of the oldest event the slot's reader has read and not relayed (0 when none), as it last reported; while no reader has reported for 30 s and the slot holds WAL, the time since its last confirmed position."),
		walLost:       d("wal_slot_lost", "1 when the WAL outbox's replication slot is gone or lost its WAL: events are lost and workers in wal mode cannot commit (docs/production/wal-outbox.md, Slot loss)."),
	}
}

func (o *opsMetrics) collect(ch chan<- prometheus.Metric, s *Stats, fns map[string]FunctionCounters) {
	stallAfter := o.src.StallAfter
	if stallAfter <= 0 {
		stallAfter = settings.DefaultStallAfter
	}
	stalled := map[string]int{}
	for name := range fns {
		stalled[name] = 0
	}
	now := time.Now()
	for _, p := range s.Partitions() {
		last := p.LastCommit
		if last.Before(p.ClaimedAt) {
			last = p.ClaimedAt
		}
		if p.Lag() > 0 && now.Sub(last) > stallAfter {
			stalled[p.Function]++
		}
		ch <- prometheus.MustNewConstMetric(o.sinceCmt, prometheus.GaugeValue, now.Sub(last).Seconds(), p.Function, p.Topic, strconv.Itoa(int(p.Partition)))
	}
	for name, n := range stalled {
		ch <- prometheus.MustNewConstMetric(o.stalled, prometheus.GaugeValue, float64(n), name)
	}
	for name, f := range fns {
		ch <- prometheus.MustNewConstMetric(o.leases, prometheus.GaugeValue, float64(f.Leases), name)
	}
	o.collectOutbox(ch)
}

// collectOutbox exposes the outbox gauges from a sample at most
// outboxSampleEvery old. The query never scans the table: the count stops
// at outboxExactCount rows, and the oldest row is found through the primary
// key (the smallest id is the earliest insert still there).
func (o *opsMetrics) collectOutbox(ch chan<- prometheus.Metric) {
	if o.src.Pool == nil {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if time.Since(o.sampledAt) >= outboxSampleEvery {
		ctx, cancel := context.WithTimeout(context.Background(), outboxSampleTimeout)
		defer cancel()
		var exact, estimate int64
		var age *float64
		err := o.src.Pool.QueryRow(ctx, `
SELECT (SELECT count(*) FROM (SELECT 1 FROM kfn.outbox LIMIT $1) t),
       (SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = 'kfn.outbox'::regclass),
       (SELECT extract(epoch FROM clock_timestamp() - created_at)::float8 FROM kfn.outbox ORDER BY id LIMIT 1)`, outboxExactCount).Scan(&exact, &estimate, &age)
		o.sampledAt = time.Now() // a failing query is not retried on every scrape either
		if err == nil {
			o.sampled = true
			o.backlog = float64(exact)
			if exact >= outboxExactCount && estimate > exact {
				o.backlog = float64(estimate)
			}
			o.oldestAge = 0
			if age != nil {
				o.oldestAge = max(*age, 0)
			}
			if wal, err := outbox.ReadWALState(ctx, o.src.Pool); err == nil {
				o.wal = wal
			}
		}
	}
	if o.sampled { // the last good sample stays while Postgres does not answer
		ch <- prometheus.MustNewConstMetric(o.outboxBacklog, prometheus.GaugeValue, o.backlog)
		ch <- prometheus.MustNewConstMetric(o.outboxAge, prometheus.GaugeValue, o.oldestAge)
	}
	if w := o.wal; w.SetUp {
		lost, age := 0.0, 0.0
		if w.Lost() {
			lost = 1
		}
		switch {
		case w.Pending > 0 && !w.OldestPending.IsZero():
			age = max(time.Since(w.OldestPending).Seconds(), 0)
		case w.LagBytes > 0 && !w.ConfirmedAt.IsZero() && time.Since(w.ReportedAt) > walReaderSilent:
			// No reader reports: whatever waits was emitted after the last
			// position it confirmed.
			age = max(time.Since(w.ConfirmedAt).Seconds(), 0)
		}
		ch <- prometheus.MustNewConstMetric(o.walHeld, prometheus.GaugeValue, float64(w.LagBytes))
		ch <- prometheus.MustNewConstMetric(o.walPending, prometheus.GaugeValue, float64(w.Pending))
		ch <- prometheus.MustNewConstMetric(o.walAge, prometheus.GaugeValue, age)
		ch <- prometheus.MustNewConstMetric(o.walLost, prometheus.GaugeValue, lost)
	}
}

func (o *opsMetrics) collectRelay(ch chan<- prometheus.Metric, r outbox.RelayStats) {
	h := r.AckLatency
	ch <- prometheus.MustNewConstHistogram(o.ackLatency, h.Count, h.Sum, h.Buckets)
}
