package engine

import (
	"context"
	"time"

	"github.com/kfn-dev/kfn/internal/preflight"
	"github.com/kfn-dev/kfn/internal/settings"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// keyConcurrency is how many key-lanes each partition (or subject lane) of
// fn runs: --key-concurrency when set, else the function's KeyConcurrency,
// else 1.
func (w *worker) keyConcurrency(fn kfn.Function) int {
	switch {
	case w.cfg.KeyConcurrency > 0:
		return w.cfg.KeyConcurrency
	case fn.KeyConcurrency > 0:
		return fn.KeyConcurrency
	}
	return 1
}

// maxKeyConcurrency is the most key-lanes a partition of the worker's
// functions runs.
func (w *worker) maxKeyConcurrency() int {
	k := 1
	for _, fn := range w.fns {
		k = max(k, w.keyConcurrency(fn))
	}
	return k
}

// defaultPoolSize is the worker's Postgres pool size when nothing asks for
// more, and poolReserve the connections a worker with key-lanes keeps
// besides its key-lanes': cursor moves, retention, retries, the relay.
const (
	defaultPoolSize = 16
	poolReserve     = 4
)

// poolSize is the size of the worker's Postgres pool when the database URL
// sets none (pool_max_conns): 16, or, with key-lanes, a connection for
// each key-lane of every partition (or subject lane) of the functions, as
// if this worker owned them all, plus poolReserve. A partition count Kafka
// does not give (the topic does not exist yet) counts as one.
func (w *worker) poolSize(ctx context.Context) int32 {
	if w.maxKeyConcurrency() <= 1 {
		return defaultPoolSize
	}
	n := poolReserve
	for _, fn := range w.fns {
		lanes := 1
		switch {
		case fn.Subject != "":
			lanes = w.cfg.Lanes
		case w.kafka != nil:
			metaCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
			if parts, err := w.kafka.Partitions(metaCtx, fn.Topic); err == nil {
				lanes = max(len(parts), 1)
			}
			cancel()
		}
		n += lanes * w.keyConcurrency(fn)
	}
	return int32(max(n, defaultPoolSize))
}

// poolTooSmall refuses a pool (pool_max_conns in the database URL) that
// cannot hold one partition's key-lanes and a cursor move at once: the
// key-lanes would wait for connections, silently slower than one lane.
func (w *worker) poolTooSmall(size int32) error {
	need := int32(w.maxKeyConcurrency() + 2)
	if w.maxKeyConcurrency() <= 1 || size >= need {
		return nil
	}
	return preflight.ConfigErrorOf(settings.DatabaseURL, "pool_max_conns=%d is too small for %d key-lanes per partition (--key-concurrency / KFN_KEY_CONCURRENCY, or the function's KeyConcurrency): "+
		"each key-lane commits on a connection of its own, so one partition needs %d (its key-lanes, its cursor's moves and one spare), and every partition this worker owns as many again; "+
		"raise pool_max_conns to at least %d, or leave it out (the worker then sizes the pool by its partitions)", size, need-2, need, need)
}
