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

// Listen wakes this process's shard loops when outbox rows commit, until ctx
// ends. It holds one dedicated Postgres connection (not from the pool) that
// LISTENs on NotifyChannel, reconnecting with backoff when it breaks; while
// it is down the shard loops fall back to polling every PollInterval. Run
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
		r.wakeAll() // idle shards switch to polling every PollInterval
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
	r.wakeAll()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return fmt.Errorf("wait for %s notification: %w", NotifyChannel, err)
		}
		r.wakeShards(n.Payload)
	}
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
