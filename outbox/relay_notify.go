package outbox

import (
	"context"
	"log/slog"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/kfn-dev/kfn/internal/pglisten"
)

// NotifyChannel is the Postgres notification channel the outbox trigger
// (migration 0002) signals after rows commit; the payload lists the shards
// written, comma separated.
const NotifyChannel = "kfn_outbox"

// Listen wakes this process's shard loops when outbox rows commit, until ctx
// ends. It holds one dedicated Postgres connection (not from the pool) that
// LISTENs on NotifyChannel, reconnecting with backoff when it breaks; while
// it is down the shard loops fall back to polling every PollInterval. Run
// calls it; a caller that drives RunShard itself should run it beside.
func (r *Relay) Listen(ctx context.Context) {
	pprof.Do(ctx, profileLabels, r.listen)
}

func (r *Relay) listen(ctx context.Context) {
	defer r.counters.listening.Store(false)
	pglisten.Run(ctx, pglisten.Config{
		Conn:    r.cfg.Pool.Config().ConnConfig,
		Channel: NotifyChannel,
		Backoff: r.newBackoff(),
		Notify:  r.wakeShards,
		Listening: func() {
			r.repeats.Over(ctx, r.log, listenLost)
			r.counters.listening.Store(true)
			// Rows may have committed while nobody listened.
			r.wakeAll()
		},
		Lost: func(err error, retryIn time.Duration) {
			r.counters.listening.Store(false)
			r.wakeAll() // idle shards switch to polling every PollInterval
			r.repeats.Failed(ctx, r.log, slog.LevelWarn, listenLost, "err", err, "retry_in", retryIn)
		},
	})
}

// wakeShards wakes the shards named in a notification payload, or all of
// them when the payload names none it understands.
func (r *Relay) wakeShards(payload string) {
	woke := false
	for _, field := range strings.Split(payload, ",") {
		shard, err := strconv.Atoi(strings.TrimSpace(field))
		if err != nil || shard < 0 || shard >= Shards {
			continue
		}
		r.wakeShard(shard)
		woke = true
	}
	if !woke {
		r.wakeAll()
	}
}

func (r *Relay) wakeAll() {
	for shard := range Shards {
		r.wakeShard(shard)
	}
}

// wakeShard marks the shard as having work; repeated wakes before the loop
// looks coalesce into one.
func (r *Relay) wakeShard(shard int) {
	select {
	case r.wake[shard] <- struct{}{}:
	default:
	}
}
