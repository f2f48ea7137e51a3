package observe

import (
	"maps"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	kfn "github.com/kfn-dev/kfn/runtime"
)

// This file holds the per-function breakdown of a worker's counters and the
// latency histograms (issue 12). The worker-level fields of Stats stay as
// they were; these are counted next to them.

// FunctionCounters are one function's counters on this worker
// (runtime/worker's FunctionCounters, which documents them).
type FunctionCounters struct {
	Applied, Duplicates, Retries, Batches, InfraRetries, Fenced                         int64
	DeadLettered                                                                        map[string]int64 // per reason
	TraceContextDropped, AbandonedHandlers, AbandonedHandlersRunning, CommitRepliesLost int64
	DeadLetterRetriesApplied, DeadLetterRetriesFailed, KeyParked, FenceTerminateDenied  int64
	Leases                                                                              int64
}

type functionStats struct {
	mu  sync.Mutex
	fns map[string]*FunctionCounters
}

// CountFn applies f to fn's counters.
func (s *Stats) CountFn(fn string, f func(*FunctionCounters)) {
	s.fs.mu.Lock()
	defer s.fs.mu.Unlock()
	if s.fs.fns == nil {
		s.fs.fns = map[string]*FunctionCounters{}
	}
	c := s.fs.fns[fn]
	if c == nil {
		c = &FunctionCounters{DeadLettered: map[string]int64{}}
		s.fs.fns[fn] = c
	}
	f(c)
}

// Functions returns a copy of the per-function counters.
func (s *Stats) Functions() map[string]FunctionCounters {
	s.fs.mu.Lock()
	defer s.fs.mu.Unlock()
	out := make(map[string]FunctionCounters, len(s.fs.fns))
	for name, c := range s.fs.fns {
		cp := *c
		cp.DeadLettered = maps.Clone(c.DeadLettered)
		out[name] = cp
	}
	return out
}

// LaneHeld counts a lane of fn as held until the returned function runs.
func (s *Stats) LaneHeld(fn string) (release func()) {
	s.CountFn(fn, func(c *FunctionCounters) { c.Leases++ })
	return func() { s.CountFn(fn, func(c *FunctionCounters) { c.Leases-- }) }
}

// Histogram buckets.
var (
	batchSizeBuckets = []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000}
	// durations in seconds, 1 ms .. 60 s
	durationBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}
	// record age at commit in seconds, 10 ms .. 1 day
	ageBuckets = []float64{.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 86400}
)

// histograms are the worker's latency and size distributions, per function.
type histograms struct {
	batchSize, batchDuration, handlerDuration, recordAge *prometheus.HistogramVec
}

func newHistograms() *histograms {
	h := func(name, help string, buckets []float64) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kfn_" + name, Help: help, Buckets: buckets}, []string{"function"})
	}
	return &histograms{
		batchSize:       h("batch_records", "Records per committed batch transaction (applied, duplicates and oversized dead letters).", batchSizeBuckets),
		batchDuration:   h("batch_duration_seconds", "Duration of a committed batch transaction, from BEGIN to the COMMIT's reply.", durationBuckets),
		handlerDuration: h("handler_duration_seconds", "Duration of one handler call (a record's Handler or a batch's BatchHandler), whatever its outcome.", durationBuckets),
		recordAge:       h("record_age_at_commit_seconds", "Now minus the Kafka record's timestamp when its transaction committed (applied records with a timestamp only).", ageBuckets),
	}
}

func (s *Stats) hist() *histograms {
	s.histOnce.Do(func() { s.histograms = newHistograms() })
	return s.histograms
}

func (h *histograms) collectors() []prometheus.Collector {
	return []prometheus.Collector{h.batchSize, h.batchDuration, h.handlerDuration, h.recordAge}
}

// ObserveCommit records a committed batch of n records of fn that began at
// start, of which applied went through the handler (duplicates are not
// aged: a redelivery would skew the age).
func (s *Stats) ObserveCommit(fn string, n int, applied []kfn.Record, start time.Time) {
	h := s.hist()
	now := time.Now()
	h.batchSize.WithLabelValues(fn).Observe(float64(n))
	h.batchDuration.WithLabelValues(fn).Observe(now.Sub(start).Seconds())
	if f := s.onCommit.Load(); f != nil {
		(*f)(fn, n, now.Sub(start))
	}
	age := h.recordAge.WithLabelValues(fn)
	for _, r := range applied {
		if r.Time.IsZero() || r.EventID != "" { // Kafka records only
			continue
		}
		age.Observe(max(now.Sub(r.Time).Seconds(), 0))
	}
}

// OnCommit has f called, on the lane's goroutine, after each committed batch
// transaction of any function of the worker: the function, the batch's
// records and the time from its BEGIN to the COMMIT's reply (what
// kfn_batch_duration_seconds observes, unbucketed). kfn bench takes its
// commit latency from it. f must be quick.
func (s *Stats) OnCommit(f func(fn string, records int, took time.Duration)) {
	s.onCommit.Store(&f)
}

// ObserveHandler records one handler call of fn that took d.
func (s *Stats) ObserveHandler(fn string, d time.Duration) {
	s.hist().handlerDuration.WithLabelValues(fn).Observe(d.Seconds())
}
