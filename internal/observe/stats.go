package observe

import (
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// Stats is where a worker counts: the engine adds to it, the metrics read
// it. Users read it through runtime/worker's Stats, PartitionStats and
// FunctionCounters, which document every counter once: Stats' fields are
// the atomics runtime/worker.Stats points at, and PartitionStats and
// FunctionCounters convert to runtime/worker's, so the compiler keeps the
// two in step.
type Stats struct {
	Applied, Duplicates, DeadLettered, Retries, Batches, Fenced, InfraRetries atomic.Int64
	TraceContextDropped, AbandonedHandlers, AbandonedHandlersRunning          atomic.Int64
	CommitRepliesLost, BatchRoundTrips                                        atomic.Int64
	DeadLetterRetriesApplied, DeadLetterRetriesFailed, KeyParked              atomic.Int64

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

// PartitionStats is the state of one owned lane (runtime/worker's
// PartitionStats, which documents it).
type PartitionStats struct {
	Function, Topic              string
	Partition                    int32
	Epoch, NextOffset, HighWater int64
	LastCommit, ClaimedAt        time.Time
	ParkedKeys                   int
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
