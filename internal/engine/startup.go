package engine

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// FirstCommitMsg is the message of the one line a worker logs, at Info,
// when its first transaction that applies records commits: "after" is the
// time since NewWorker was called, and "phases" holds, for each phase of
// the start, when it began and ended ("from", "to", since NewWorker). kfn
// bench's start-up measurement reads it; an operator reads how long a
// worker scaled from zero took to do work, and where that time went.
const FirstCommitMsg = "first commit"

// The phases of a worker's start, in the order they end on an idle
// machine. The connections to Postgres, Kafka and NATS run side by side.
const (
	phaseConfig      = "config"       // settings and functions checked, tracing set up
	phasePostgres    = "postgres"     // the pool's first connection, the schema version, the role's rights
	phaseKafka       = "kafka"        // the topic's metadata
	phaseNATS        = "nats"         // connected, JetStream opened
	phaseLeaseBucket = "lease_bucket" // the partition leases' bucket opened (created if missing)
	phaseRelay       = "relay"        // the event stream and the relay's lease groups
	phaseSetup       = "setup"        // the functions' Setup
	phaseLease       = "lease"        // from Run to the first lease acquired
	phaseFence       = "fence"        // that lane's claim in Postgres: its token raised over the epoch, its cursor read
	phaseFetch       = "fetch"        // that lane's first batch read from Kafka
	phaseCommit      = "commit"       // the first batch's transaction, to its COMMIT's reply
)

// startClock times a worker's start, from NewWorker to its first commit:
// each phase is recorded once (the first lane to reach it), and the first
// commit logs them all in one line (FirstCommitMsg). After that it
// records nothing: it costs the batch path one atomic load. A nil clock
// records nothing.
type startClock struct {
	began time.Time
	done  atomic.Bool
	mu    sync.Mutex
	spans []startSpan
	first chan struct{}
}

type startSpan struct {
	name     string
	from, to time.Duration
}

func newStartClock() *startClock { return &startClock{began: time.Now(), first: make(chan struct{})} }

// phase records that phase name began at from and ends now, unless it is
// already recorded or the first commit has been logged.
func (c *startClock) phase(name string, from time.Time) {
	if c == nil || c.done.Load() {
		return
	}
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, s := range c.spans {
		if s.name == name {
			return
		}
	}
	c.spans = append(c.spans, startSpan{name: name, from: from.Sub(c.began), to: now.Sub(c.began)})
}

// timed runs f as phase name.
func (c *startClock) timed(name string, f func() error) error {
	began := time.Now()
	err := f()
	if err == nil {
		c.phase(name, began)
	}
	return err
}

// committed records the first commit, begun at began, and logs the start's
// phases; later commits do nothing.
func (c *startClock) committed(log *slog.Logger, began time.Time) {
	if c == nil || c.done.Load() {
		return
	}
	c.phase(phaseCommit, began)
	if !c.done.CompareAndSwap(false, true) {
		return
	}
	close(c.first)
	c.mu.Lock()
	defer c.mu.Unlock()
	phases := make([]any, len(c.spans))
	for i, s := range c.spans {
		phases[i] = slog.Group(s.name, "from", s.from, "to", s.to)
	}
	log.Info(FirstCommitMsg, "after", time.Since(c.began), slog.Group("phases", phases...))
}

// afterFirstCommit returns once the first commit is logged, or after
// bound, or when ctx ends, whichever comes first.
func (c *startClock) afterFirstCommit(ctx context.Context, bound time.Duration) {
	t := time.NewTimer(bound)
	defer t.Stop()
	select {
	case <-c.first:
	case <-t.C:
	case <-ctx.Done():
	}
}
