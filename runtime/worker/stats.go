package worker

import (
	"sync/atomic"
	"time"

	"github.com/kfn-dev/kfn/internal/observe"
)

// Stats are a worker's live counters, for progress displays and metrics.
// Each counter is the worker's own: Load it for its current value.
type Stats struct {
	Applied      *atomic.Int64 // records whose handler transaction committed
	Duplicates   *atomic.Int64 // records skipped because they were handled before
	DeadLettered *atomic.Int64 // records parked in kfn.dead_letters
	Retries      *atomic.Int64 // handler retries
	Batches      *atomic.Int64 // committed transactions
	Fenced       *atomic.Int64 // partitions dropped because a newer owner claimed them
	// InfraRetries counts batches whose apply failed with an infrastructure
	// error (Postgres, Kafka or NATS failing, not a record) and was retried.
	InfraRetries *atomic.Int64
	// TraceContextDropped counts records whose traceparent, tracestate or
	// baggage header was not valid W3C Trace Context or Baggage and was
	// ignored: not followed by their handler span (tracing on) and not
	// propagated to the events they emitted. With tracing off a record is
	// looked at only when it emits.
	TraceContextDropped *atomic.Int64
	// AbandonedHandlers counts handler calls that overran --handler-timeout
	// and did not return: the lane ended their transaction's session and
	// went on without them. AbandonedHandlersRunning is how many of those
	// are still running (Go cannot stop them).
	AbandonedHandlers        *atomic.Int64
	AbandonedHandlersRunning *atomic.Int64
	// CommitRepliesLost counts commits that landed although the worker saw
	// them fail (the connection died at COMMIT): the lane found the cursor
	// ahead under its own token and resumed from it.
	CommitRepliesLost *atomic.Int64
	// BatchRoundTrips counts the Postgres round trips of batch transactions
	// (begin and claim, the handler's statements, outbox and commit).
	BatchRoundTrips *atomic.Int64
	// DeadLetterRetriesApplied counts dead letters marked for retry (kfn dlq
	// retry) that this worker's lanes applied; DeadLetterRetriesFailed those
	// whose retry failed again (the letter stays). Neither is in Applied or
	// DeadLettered.
	DeadLetterRetriesApplied *atomic.Int64
	DeadLetterRetriesFailed  *atomic.Int64
	// KeyParked counts the records dead-lettered with reason key_parked: a
	// function with KeyOrder ParkKey parked them behind an earlier dead
	// letter of their key. They are in DeadLettered too.
	KeyParked *atomic.Int64

	s *observe.Stats
}

func newStats(s *observe.Stats) *Stats {
	return &Stats{
		Applied:                  &s.Applied,
		Duplicates:               &s.Duplicates,
		DeadLettered:             &s.DeadLettered,
		Retries:                  &s.Retries,
		Batches:                  &s.Batches,
		Fenced:                   &s.Fenced,
		InfraRetries:             &s.InfraRetries,
		TraceContextDropped:      &s.TraceContextDropped,
		AbandonedHandlers:        &s.AbandonedHandlers,
		AbandonedHandlersRunning: &s.AbandonedHandlersRunning,
		CommitRepliesLost:        &s.CommitRepliesLost,
		BatchRoundTrips:          &s.BatchRoundTrips,
		DeadLetterRetriesApplied: &s.DeadLetterRetriesApplied,
		DeadLetterRetriesFailed:  &s.DeadLetterRetriesFailed,
		KeyParked:                &s.KeyParked,
		s:                        s,
	}
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
func (p PartitionStats) Lag() int64 { return observe.PartitionStats(p).Lag() }

// Partitions returns the owned partitions, sorted.
func (s *Stats) Partitions() []PartitionStats {
	ps := s.s.Partitions()
	out := make([]PartitionStats, len(ps))
	for i, p := range ps {
		out[i] = PartitionStats(p)
	}
	return out
}

// Lag sums the lag of all owned partitions.
func (s *Stats) Lag() int64 { return s.s.Lag() }

// FunctionCounters are one function's counters on this worker.
type FunctionCounters struct {
	Applied, Duplicates, Retries, Batches, InfraRetries, Fenced int64
	// DeadLettered is per reason (panic, timeout, data_error, permanent,
	// handler_error, oversized, key_parked).
	DeadLettered                                                                        map[string]int64
	TraceContextDropped, AbandonedHandlers, AbandonedHandlersRunning, CommitRepliesLost int64
	DeadLetterRetriesApplied, DeadLetterRetriesFailed                                   int64
	// KeyParked counts records dead-lettered as key_parked (KeyOrder ParkKey).
	KeyParked int64
	// FenceTerminateDenied counts lane claims refused because an older
	// owner's session held the cursor row and this worker's role may not
	// end it (inbox.ErrCannotEndOlderOwner); each is retried.
	FenceTerminateDenied int64
	// Leases is how many lanes (partitions or subjects) of the function this
	// worker holds now.
	Leases int64
}

// Functions returns a copy of the per-function counters, by function.
func (s *Stats) Functions() map[string]FunctionCounters {
	fs := s.s.Functions()
	out := make(map[string]FunctionCounters, len(fs))
	for name, c := range fs {
		out[name] = FunctionCounters(c)
	}
	return out
}

// OnCommit has f called, on the lane's goroutine, after each committed batch
// transaction of any function of the worker: the function, the batch's
// records and the time from its BEGIN to the COMMIT's reply (what
// kfn_batch_duration_seconds observes, unbucketed). f must be quick.
func (s *Stats) OnCommit(f func(fn string, records int, took time.Duration)) { s.s.OnCommit(f) }
