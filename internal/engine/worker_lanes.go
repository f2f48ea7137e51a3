package engine

import (
	"context"
	"errors"
	"log/slog"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/observe"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// runPartition owns one partition until ctx ends or a newer owner fences it.
// It returns after the in-flight batch has committed or rolled back.
func (w *worker) runPartition(ctx context.Context, fn kfn.Function, partition int32, token int64) {
	part := inbox.Partition{Consumer: fn.Name, Topic: fn.Topic, Partition: partition}
	cursor := &partitionTracker{part: part, token: token, stats: w.stats, onCommit: func(next int64) {
		w.offsets.Note(w.consumerGroup(fn), part.Topic, part.Partition, next)
	}}
	var lane cursorLane = cursor
	if w.partitionTracker != nil {
		lane = w.partitionTracker(cursor)
	}
	log := w.cfg.Logger.With("function", fn.Name, "topic", fn.Topic, "partition", partition, "epoch", token)
	pr := &partitionRun{applier: w.newApplier(fn, part, token, lane, log), w: w, cursor: cursor, lane: lane}
	if fn.KeyOrder == kfn.ParkKey {
		pr.held = newHeldKeys(func(n int) {
			w.stats.Update(fn.Name, fn.Topic, partition, func(p *observe.PartitionStats) { p.ParkedKeys = n })
		})
	}
	pr.retry = w.retries.register(pr.applier, "")
	if pr.retry != nil {
		pr.wakeRetries = pr.retry.signal
	}
	defer w.retries.unregister(pr.retry)
	defer w.stats.Drop(fn.Name, fn.Topic, partition)
	defer w.stats.LaneHeld(fn.Name)()
	w.laneStopped(ctx, pr.applier, pr.run(ctx))
}

// laneStopped logs why a lane (a partition or a subject) stopped, and
// when it was asked to stop, what its batch in flight did: an operator
// reading a slow shutdown or handoff sees which lane held it and why.
func (w *worker) laneStopped(ctx context.Context, a *applier, err error) {
	var fenced *inbox.FencedError
	switch {
	case errors.As(err, &fenced):
		w.stats.Fenced.Add(1)
		w.stats.CountFn(a.fn.Name, func(c *observe.FunctionCounters) { c.Fenced++ })
		a.log.Warn("fenced by a newer owner: dropping it", "old_epoch", a.token, "new_epoch", fenced.Epoch)
	case err != nil && ctx.Err() == nil:
		a.log.Error("stopped", "err", err)
	case a.atStop.records > 0:
		a.log.Info("lane stopped: its batch in flight "+a.atStop.outcome, "records", a.atStop.records, "cause", context.Cause(ctx).Error())
	default:
		a.log.Debug("lane stopped: no batch in flight", "cause", context.Cause(ctx).Error())
	}
}

// claimBlocked counts a claim of fn's lane refused because an older
// owner's session holds the cursor row and this worker's role may not end
// it (inbox.ErrCannotEndOlderOwner), and says so once per worker: the
// claim is retried until that session's transaction ends on its own, which
// can take up to --handler-timeout (the server's idle-in-transaction
// limit) instead of about --lease-renew.
func (w *worker) claimBlocked(fn string, log *slog.Logger, err error) {
	if !errors.Is(err, inbox.ErrCannotEndOlderOwner) {
		return
	}
	w.stats.CountFn(fn, func(c *observe.FunctionCounters) { c.FenceTerminateDenied++ })
	w.terminateDenied.Do(func() {
		log.Warn("cannot end a frozen older owner's Postgres session: this worker's role may not signal it (another role, and no pg_signal_backend; or the older session is a superuser's), "+
			"so claims wait for the older transaction to end on its own (counted in kfn_fence_terminate_denied_total); "+
			"run every worker as one role, or GRANT pg_signal_backend to the workers' role", "err", err)
	})
}

// runSubject owns one lane of fn's subject until ctx ends or a newer owner
// fences it.
func (w *worker) runSubject(ctx context.Context, fn kfn.Function, lane int32, token int64) {
	part := inbox.Partition{Consumer: fn.Name, Topic: fn.Subject, Partition: lane}
	stream := fn.Stream
	if stream == "" {
		stream = DefaultStream
	}
	log := w.cfg.Logger.With("function", fn.Name, "subject", fn.Subject, "stream", stream, "lane", lane, "lanes", w.cfg.Lanes, "epoch", token)
	sr := &subjectRun{
		applier: w.newApplier(fn, part, token, &subjectTracker{consumer: fn.Name, part: part, token: token}, log),
		w:       w,
		stream:  stream,
		lane:    int(lane),
		lanes:   w.cfg.Lanes,
	}
	sr.retry = w.retries.register(sr.applier, stream)
	defer w.retries.unregister(sr.retry)
	defer w.stats.Drop(fn.Name, fn.Subject, lane)
	defer w.stats.LaneHeld(fn.Name)()
	w.laneStopped(ctx, sr.applier, sr.run(ctx))
}

// newApplier returns the applier of one lane of fn, committing through
// tracker with the worker's pool, settings and counters.
func (w *worker) newApplier(fn kfn.Function, part inbox.Partition, token int64, tracker tracker, log *slog.Logger) *applier {
	return &applier{pool: w.pool, cfg: &w.cfg, stats: w.stats, fn: fn, part: part, token: token, tracker: tracker, log: log, repeats: w.repeats, tracer: w.tracer, start: w.start}
}
