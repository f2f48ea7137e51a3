// Package repeatlog logs a failure that is retried: each kind of failure
// once per step of a backoff, with the count of the failures it held back,
// instead of once per retry. It owns that schedule and nothing else. A
// worker retrying an unreachable Postgres in eight lanes, its relay's
// shards and its probes would otherwise write a line per lane and retry
// (an 8 s outage once gave one worker 237 identical warnings).
//
// The schedule, per kind: the first failure of a run is logged at once;
// later ones are counted, and the first that comes at least one step after
// the last line is logged with the count, as "… (repeated 12 times in
// 4s)". The step starts at 1 s and doubles after each line, up to a
// minute. So an outage of D seconds logs at most 1 + log2(D+1) lines of a
// kind, plus one when it is over (Over): 4 lines for 6 s, 8 for 2 minutes,
// then one a minute.
//
// A kind is the message of the line (what failed, "apply batch failed,
// retrying"), whatever the error says: the line carries the last error.
// One Log is shared by the parts of a process that fail alike (a worker's
// lanes, a relay's shards, a lease manager's leases), so that eight lanes
// failing at once make one line, not eight.
package repeatlog

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

const (
	// FirstStep is the shortest time between two lines of one kind.
	FirstStep = time.Second
	// MaxStep is the longest: a failure that goes on is logged this often.
	MaxStep = time.Minute
)

// Log counts the failures of each kind and says when a line is due. The
// zero value is not usable; use New. Its methods may be called from any
// goroutine.
type Log struct {
	mu    sync.Mutex
	kinds map[string]*run
	now   func() time.Time
}

// run is a kind's failures since it last succeeded (Over).
type run struct {
	first   time.Time     // the run's first failure
	lastAt  time.Time     // its last line
	step    time.Duration // after lastAt, the next failure is logged
	held    int           // failures since the last line, not logged
	failed  int           // failures in the run
	level   slog.Level    // of its lines
	lastErr []any         // the args of the last failure, for Over
}

// New returns an empty Log.
func New() *Log { return &Log{kinds: map[string]*run{}, now: time.Now} }

// Failed logs a failure of the kind msg at level on log, with args, if a
// line is due by the schedule; otherwise it counts it. A line after the
// first says how many failures it stands for, and over how long.
func (l *Log) Failed(ctx context.Context, log *slog.Logger, level slog.Level, msg string, args ...any) {
	now := l.now()
	l.mu.Lock()
	r := l.kinds[msg]
	if r == nil {
		r = &run{first: now, lastAt: now, step: FirstStep, level: level}
		l.kinds[msg] = r
		r.failed = 1
		l.mu.Unlock()
		log.Log(ctx, level, msg, args...)
		return
	}
	r.failed++
	r.held++
	r.lastErr = args
	if now.Sub(r.lastAt) < r.step {
		l.mu.Unlock()
		return
	}
	held, since := r.held, now.Sub(r.lastAt)
	r.held, r.lastAt, r.step = 0, now, min(2*r.step, MaxStep)
	l.mu.Unlock()
	log.Log(ctx, level, fmt.Sprintf("%s (repeated %d %s in %s)", msg, held, times(held), round(since)), args...)
}

// Over ends the run of failures of the kind msg, if there is one: it
// logs, at info, that it is over, how many failures it had and for how
// long, with the last failure's args. A run of one failure, already
// logged, ends without a line. The next failure of the kind starts a new
// run, logged at once.
func (l *Log) Over(ctx context.Context, log *slog.Logger, msg string) {
	now := l.now()
	l.mu.Lock()
	r := l.kinds[msg]
	delete(l.kinds, msg)
	l.mu.Unlock()
	if r == nil || r.failed < 2 {
		return
	}
	args := append([]any{"failures", r.failed, "for", round(now.Sub(r.first))}, r.lastErr...)
	log.Log(ctx, slog.LevelInfo, fmt.Sprintf("over: %s (%d %s in %s)", msg, r.failed, times(r.failed), round(now.Sub(r.first))), args...)
}

func times(n int) string {
	if n == 1 {
		return "time"
	}
	return "times"
}

// round shortens a duration for a message: 4s, 1.3s, 250ms.
func round(d time.Duration) time.Duration {
	if d >= 10*time.Second {
		return d.Round(time.Second)
	}
	return d.Round(100 * time.Millisecond)
}
