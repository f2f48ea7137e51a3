package observe

import (
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// Stats are a worker's live counters, for progress displays and metrics.
type Stats struct {
	Applied      atomic.Int64 // records whose handler transaction committed
	Duplicates   atomic.Int64 // records skipped because they were handled before
	DeadLettered atomic.Int64 // records parked in kfn.dead_letters
	Retries      atomic.Int64 // handler retries
	Batches      atomic.Int64 // committed transactions
	Fenced       atomic.Int64 // partitions dropped because a newer owner claimed them
	// InfraRetries counts batches whose apply failed with an infrastructure
	// error (Postgres, Kafka or NATS failing, not a record) and was retried.
	InfraRetries atomic.Int64
	// TraceContextDropped counts records whose traceparent, tracestate or
	// baggage header was not valid W3C Trace Context or Baggage and was
	// ignored: not followed by their handler span (tracing on) and not
	// propagated to the events they emitted. With tracing off a record is
	// looked at only when it emits.
	TraceContextDropped atomic.Int64
	// AbandonedHandlers counts handler calls that overran --handler-timeout
	// and did not return: the lane ended their transaction's session and
	// went on without them. AbandonedHandlersRunning is how many of those
	// are still running (Go cannot stop them).
	AbandonedHandlers        atomic.Int64
	AbandonedHandlersRunning atomic.Int64
	// CommitRepliesLost counts commits that landed although the worker saw
	// them fail (the connection died at COMMIT): the lane found the cursor
	// ahead under its own token and resumed from it.
	CommitRepliesLost atomic.Int64
	// BatchRoundTrips counts the Postgres round trips of batch transactions
	// (begin and claim, the handler's statements, outbox and commit).
	BatchRoundTrips atomic.Int64
	// DeadLetterRetriesApplied counts dead letters marked for retry (kfn dlq
	// retry) that this worker's lanes applied; DeadLetterRetriesFailed those
	// whose retry failed again (the letter stays). Neither is in Applied or
	// DeadLettered.
	DeadLetterRetriesApplied atomic.Int64
	DeadLetterRetriesFailed  atomic.Int64
	// KeyParked counts the records dead-lettered with reason key_parked: a
	// function with KeyOrder ParkKey parked them behind an earlier dead
	// letter of their key. They are in DeadLettered too.
	KeyParked atomic.Int64

	mu         sync.Mutex
	partitions map[partitionKey]*PartitionStats

	// Per-function counters and histograms (stats_observe.go).
	fs         functionStats
	histOnce   sync.Once
	histograms *histograms
	// onCommit, when set (OnCommit), gets each committed batch's timing.
	onCommit atomic.Pointer[func(fn string, records int, took time.Duration)]
}

type partitionKey struct {
	function  string
	topic     string
	partition int32
}

// PartitionStats is the state of one owned partition.
type PartitionStats struct {
	Function   string
	Topic      string
	Partition  int32
	Epoch      int64
	NextOffset int64
	HighWater  int64 // Kafka high watermark seen on the last fetch
	LastCommit time.Time
	ClaimedAt  time.Time // when this worker claimed the lane
	// ParkedKeys is how many keys of the partition hold their records back
	// (KeyOrder ParkKey): parked behind a dead letter, or released with
	// parked records still to retry.
	ParkedKeys int
}

// Lag is how many records are behind the cursor.
func (p PartitionStats) Lag() int64 {
	if p.HighWater < p.NextOffset {
		return 0
	}
	return p.HighWater - p.NextOffset
}

// Update applies f to the state of a lane (fn's partition or subject lane
// of topic), which it creates when the lane has none.
func (s *Stats) Update(fn, topic string, partition int32, f func(*PartitionStats)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.partitions == nil {
		s.partitions = map[partitionKey]*PartitionStats{}
	}
	k := partitionKey{fn, topic, partition}
	p := s.partitions[k]
	if p == nil {
		p = &PartitionStats{Function: fn, Topic: topic, Partition: partition, ClaimedAt: time.Now()}
		s.partitions[k] = p
	}
	f(p)
}

// Drop forgets a lane the worker no longer owns.
func (s *Stats) Drop(fn, topic string, partition int32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.partitions, partitionKey{fn, topic, partition})
}

// Partitions returns the owned partitions, sorted.
func (s *Stats) Partitions() []PartitionStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]PartitionStats, 0, len(s.partitions))
	for _, p := range s.partitions {
		out = append(out, *p)
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.Function != b.Function {
			return a.Function < b.Function
		}
		if a.Topic != b.Topic {
			return a.Topic < b.Topic
		}
		return a.Partition < b.Partition
	})
	return out
}

// Lag sums the lag of all owned partitions.
func (s *Stats) Lag() int64 {
	var total int64
	for _, p := range s.Partitions() {
		total += p.Lag()
	}
	return total
}
