package outbox

import (
	"sync/atomic"
	"time"
)

// RelayStats is a snapshot of a relay's counters for a status display.
type RelayStats struct {
	// Published counts events the stream acked as new.
	Published uint64
	// Duplicates counts events the stream acked as duplicates of an earlier
	// publish (a republish after a crash or a failed ack).
	Duplicates uint64
	// Failures counts publishes that failed or timed out and were retried.
	Failures uint64
	// Parked counts keys parked because the stream kept rejecting an event.
	Parked uint64
	// LastLatency is, for the most recent ack, the time from the event's
	// emit (its created_at, taken just before its transaction committed) to
	// the stream ack.
	LastLatency time.Duration
	// LastPublishedAt is when the most recent ack arrived; zero if none yet.
	LastPublishedAt time.Time
	// ActiveShards is the number of shard loops running now.
	ActiveShards int
	// Listening reports whether the LISTEN connection is up (when it is down
	// the relay only polls).
	Listening bool
	// AckLatency is the distribution of LastLatency over every ack.
	AckLatency LatencyHistogram
	// WAL is the WAL outbox slot reader's state (see RelayConfig.Mode).
	WAL WALStats
}

// AckLatencyBuckets are the upper bounds, in seconds, of the relay's
// commit-to-ack latency histogram.
var AckLatencyBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300}

// LatencyHistogram is a cumulative histogram in seconds, as Prometheus has it.
type LatencyHistogram struct {
	Count   uint64
	Sum     float64            // seconds
	Buckets map[float64]uint64 // upper bound → cumulative count
}

type latencyHistogram struct {
	counts [17]atomic.Uint64 // per AckLatencyBuckets bound, then +Inf
	sumNs  atomic.Int64
}

func (h *latencyHistogram) observe(d time.Duration) {
	s := d.Seconds()
	i := 0
	for i < len(AckLatencyBuckets) && s > AckLatencyBuckets[i] {
		i++
	}
	h.counts[i].Add(1)
	h.sumNs.Add(int64(d))
}

func (h *latencyHistogram) snapshot() LatencyHistogram {
	out := LatencyHistogram{Buckets: make(map[float64]uint64, len(AckLatencyBuckets))}
	var cum uint64
	for i, le := range AckLatencyBuckets {
		cum += h.counts[i].Load()
		out.Buckets[le] = cum
	}
	out.Count = cum + h.counts[len(AckLatencyBuckets)].Load()
	out.Sum = time.Duration(h.sumNs.Load()).Seconds()
	return out
}

type relayCounters struct {
	published    atomic.Uint64
	duplicates   atomic.Uint64
	failures     atomic.Uint64
	parked       atomic.Uint64
	lastLatency  atomic.Int64 // nanoseconds
	lastAckAt    atomic.Int64 // unix nanoseconds
	activeShards atomic.Int64
	listening    atomic.Bool
	// The WAL slot reader's: whether it holds the slot, found it lost, and
	// its backlog (events, and the oldest one's emit time in unix ns).
	slotHeld   atomic.Bool
	slotLost   atomic.Bool
	walPending atomic.Int64
	walOldest  atomic.Int64
	walRead    atomic.Uint64 // events read from the slot
	walHeld    atomic.Int64  // bytes between the server's WAL end and the confirmed position
	ackLatency latencyHistogram
}

func (c *relayCounters) acked(duplicate bool, createdAt, now time.Time) {
	if duplicate {
		c.duplicates.Add(1)
	} else {
		c.published.Add(1)
	}
	c.lastLatency.Store(int64(now.Sub(createdAt)))
	c.ackLatency.observe(max(now.Sub(createdAt), 0))
	c.lastAckAt.Store(now.UnixNano())
}

// Stats returns the relay's counters since it was made.
func (r *Relay) Stats() RelayStats {
	c := &r.counters
	s := RelayStats{
		Published:    c.published.Load(),
		Duplicates:   c.duplicates.Load(),
		Failures:     c.failures.Load(),
		Parked:       c.parked.Load(),
		LastLatency:  time.Duration(c.lastLatency.Load()),
		ActiveShards: int(c.activeShards.Load()),
		Listening:    c.listening.Load(),
		AckLatency:   c.ackLatency.snapshot(),
		WAL: WALStats{Reading: c.slotHeld.Load(), Read: c.walRead.Load(), Pending: c.walPending.Load(),
			HeldBytes: c.walHeld.Load(), SlotLost: c.slotLost.Load()},
	}
	if at := c.walOldest.Load(); at != 0 {
		s.WAL.OldestPending = time.Unix(0, at)
	}
	if at := c.lastAckAt.Load(); at != 0 {
		s.LastPublishedAt = time.Unix(0, at)
	}
	return s
}
