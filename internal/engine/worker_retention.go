package engine

import (
	"context"
	"log/slog"
	"time"

	"github.com/kfn-dev/kfn/inbox"
)

// purgeBatch is how many inbox rows one DELETE removes; small batches keep
// locks short under load.
const purgeBatch = 1000

// purgeEvery is how often the inbox is purged: often enough that one purge
// has little to do, and never more than once a minute in production.
func purgeEvery(retention time.Duration) time.Duration {
	return min(time.Minute, max(retention/4, 100*time.Millisecond))
}

// purgeInboxes deletes inbox rows older than the retention, and dead
// letters older than theirs, until ctx ends.
// Kafka records stay deduplicated by their cursor's high-water mark; events
// of NATS-triggered functions are deduplicated only while their row exists,
// so their retention must outlast any relay outage (it does by days).
func (w *worker) purgeInboxes(ctx context.Context) {
	t := time.NewTicker(purgeEvery(w.cfg.InboxRetention))
	defer t.Stop()
	var deadLettersPurged time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		records, err := inbox.Purge(ctx, w.pool, w.cfg.InboxRetention, purgeBatch)
		if err == nil {
			var events int64
			events, err = inbox.PurgeEvents(ctx, w.pool, w.cfg.InboxRetention, purgeBatch)
			records += events
		}
		switch {
		case err != nil && ctx.Err() == nil:
			w.repeats.Failed(ctx, w.cfg.Logger, slog.LevelWarn, purgeInboxFailed, "err", err)
		case err == nil:
			w.repeats.Over(ctx, w.cfg.Logger, purgeInboxFailed)
		}
		if records > 0 {
			w.cfg.Logger.Debug("purged inbox rows", "rows", records, "retention", w.cfg.InboxRetention)
		}
		if keep := w.cfg.DeadLetterRetention; keep > 0 && time.Since(deadLettersPurged) >= min(time.Hour, keep/4) {
			deadLettersPurged = time.Now() // at most hourly: each purge that deletes writes an audit row
			_, n, err := inbox.PurgeDeadLetters(ctx, w.pool, keep, w.cfg.WorkerID, "--dead-letter-retention "+keep.String())
			if err != nil && ctx.Err() == nil {
				w.repeats.Failed(ctx, w.cfg.Logger, slog.LevelWarn, purgeDeadLettersFailed, "err", err)
			} else if err == nil {
				w.repeats.Over(ctx, w.cfg.Logger, purgeDeadLettersFailed)
			}
			if n > 0 {
				w.cfg.Logger.Info("purged dead letters", "rows", n, "retention", keep)
			}
		}
	}
}

// The kinds of the purges' failures, logged through the worker's repeats.
const (
	purgeInboxFailed       = "purge inbox failed; will retry"
	purgeDeadLettersFailed = "purge dead letters failed; will retry"
)
