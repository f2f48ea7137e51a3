package outbox

import (
	"context"
	"fmt"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// NotifyChannel is the Postgres notification channel the outbox trigger
// (migration 0002) signals after rows commit; the payload lists the shards
// written, comma separated.
const NotifyChannel = "kfn_outbox"

// Listen wakes this process's relay loop when outbox rows commit in a shard it holds, until ctx
// ends. It holds one dedicated Postgres connection (not from the pool) that
// LISTENs on NotifyChannel, reconnecting with backoff when it breaks; while
// it is down the loop falls back to polling every PollInterval. Run
// calls it; a caller that drives RunShard itself should run it beside.
func (r *Relay) Listen(ctx context.Context) {
	pprof.Do(ctx, profileLabels, r.listen)
}

func (r *Relay) listen(ctx context.Context) {
	retry := r.newBackoff()
	for ctx.Err() == nil {
		err := r.listenOnce(ctx, retry.Reset)
		r.counters.listening.Store(false)
		if ctx.Err() != nil {
			return
		}
		r.wakeLoop() // an idle loop switches to polling every PollInterval
		delay := retry.NextBackOff()
		r.log.Warn("outbox LISTEN connection lost; polling until it is back", "err", err, "retry_in", delay)
		sleepCtx(ctx, delay)
	}
}

func (r *Relay) listenOnce(ctx context.Context, connected func()) error {
	conn, err := pgx.ConnectConfig(ctx, r.cfg.Pool.Config().ConnConfig)
	if err != nil {
		return fmt.Errorf("connect to LISTEN: %w", err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		conn.Close(closeCtx) //nolint:errcheck // the connection is being dropped
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+NotifyChannel); err != nil {
		return fmt.Errorf("LISTEN %s: %w", NotifyChannel, err)
	}
	r.counters.listening.Store(true)
	connected()
	// Rows may have committed while nobody listened.
	r.wakeLoop()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return fmt.Errorf("wait for %s notification: %w", NotifyChannel, err)
		}
		r.wakeShards(n.Payload)
	}
}

// wakeShards wakes the loop when a notification payload names a shard
// this process holds, or names none it understands.
func (r *Relay) wakeShards(payload string) {
	understood := false
	for field := range strings.SplitSeq(payload, ",") {
		shard, err := strconv.Atoi(strings.TrimSpace(field))
		if err != nil || shard < 0 || shard >= Shards {
			continue
		}
		understood = true
		r.heldMu.RLock()
		held := r.held[shard] > 0
		r.heldMu.RUnlock()
		if held {
			r.wakeLoop()
			return
		}
	}
	if !understood {
		r.wakeLoop()
	}
}

// wakeLoop tells the loop there may be rows to read; repeated wakes before
// the loop looks coalesce into one.
func (r *Relay) wakeLoop() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}
