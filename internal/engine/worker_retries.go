package engine

import (
	"context"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/pglisten"
)

// watchRetries wakes the lanes of this worker that have dead letters marked
// for retry: it looks every retryPollEvery, and at once when notified,
// until ctx ends.
func (w *worker) watchRetries(ctx context.Context) {
	consumers := make([]string, len(w.fns))
	mine := map[string]bool{}
	for i, fn := range w.fns {
		consumers[i] = fn.Name
		mine[fn.Name] = true
	}
	kick := make(chan struct{}, 1)
	listenDone := make(chan struct{})
	go func() {
		defer close(listenDone)
		w.listenRetries(ctx, mine, kick)
	}()
	defer func() { <-listenDone }()
	t := time.NewTicker(retryPollEvery)
	defer t.Stop()
	for {
		lanes, err := inbox.PendingRetryLanes(ctx, w.pool, consumers)
		switch {
		case err != nil && ctx.Err() == nil:
			w.cfg.Logger.Debug("look for dead letters to retry failed; will look again", "err", err)
		case err == nil:
			for _, p := range lanes {
				w.retries.signal(p)
			}
		}
		// Lanes holding parked keys look again too: a discard may have
		// released one with no parked records to retry.
		w.retries.signalHolding()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-kick:
		}
	}
}

// listenRetries LISTENs on inbox.RetryNotifyChannel on a connection of its
// own and kicks the watcher when one of this worker's functions is named,
// reconnecting with backoff; the watcher's poll covers the gaps.
func (w *worker) listenRetries(ctx context.Context, mine map[string]bool, kick chan<- struct{}) {
	pglisten.Run(ctx, pglisten.Config{
		Conn:    w.pool.Config().ConnConfig,
		Channel: inbox.RetryNotifyChannel,
		Backoff: backoff.NewExponentialBackOff(backoff.WithInitialInterval(100*time.Millisecond), backoff.WithMaxInterval(5*time.Second), backoff.WithMaxElapsedTime(0)),
		Notify: func(payload string) {
			if mine[payload] {
				select {
				case kick <- struct{}{}:
				default:
				}
			}
		},
		Lost: func(err error, retryIn time.Duration) {
			w.cfg.Logger.Debug("dead letter retry LISTEN connection lost; polling until it is back", "err", err, "retry_in", retryIn)
		},
	})
}
