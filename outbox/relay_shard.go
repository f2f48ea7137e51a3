package outbox

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"
)

// idlePollFactor stretches the poll interval of idle shards while
// notifications work.
const idlePollFactor = 10

// errAckTimeout is a publish whose ack did not come within AckTimeout.
var errAckTimeout = errors.New("no stream ack within the ack timeout")

// errStoppedBeforeAck ends the span of a publish whose ack the shard stopped
// waiting for: its row stays in the outbox for the shard's next owner.
var errStoppedBeforeAck = errors.New("the shard stopped before the stream ack; the row stays in the outbox")

// shardLoop relays one shard. It works in batches: read the shard's oldest
// rows, publish them (per key one at a time, up to MaxInFlight keys at
// once), delete the acked ones, read again. A batch is fully settled before
// the next read, which is what lets the read go without a cursor (see
// selectShardBatch).
type shardLoop struct {
	r     *Relay
	shard int
	log   *slog.Logger

	// parked keys are skipped until the time given; their rows stay in the
	// outbox, and later rows of the key wait behind them.
	parked map[string]time.Time
	// covered caches subjects the stream was seen to capture.
	covered map[string]bool
	// publishRetry paces a shard that hit a failed publish; dbRetry paces
	// failed Postgres queries.
	publishRetry *backoff.ExponentialBackOff
	dbRetry      *backoff.ExponentialBackOff
	timer        *time.Timer
}

func newShardLoop(r *Relay, shard int) *shardLoop {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return &shardLoop{
		r:            r,
		shard:        shard,
		log:          r.log.With("shard", shard),
		parked:       map[string]time.Time{},
		covered:      map[string]bool{},
		publishRetry: r.newBackoff(),
		dbRetry:      r.newBackoff(),
		timer:        t,
	}
}

func (l *shardLoop) run(ctx context.Context) {
	defer l.timer.Stop()
	for ctx.Err() == nil {
		rows, err := readBatch(ctx, l.r.cfg.Pool, l.shard, l.parkedKeys(), l.r.cfg.BatchSize)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			delay := l.dbRetry.NextBackOff()
			l.log.Warn("outbox read failed; retrying", "err", err, "retry_in", delay)
			sleepCtx(ctx, delay)
			continue
		}
		l.dbRetry.Reset()
		if len(rows) == 0 {
			l.waitForRows(ctx)
			continue
		}
		acked := l.publishBatch(ctx, rows)
		l.deleteAcked(ctx, acked)
	}
}

// waitForRows blocks until a notification names this shard, the poll
// interval passes, or ctx ends. While the LISTEN connection is up every
// commit wakes its shards, so an idle shard polls only every
// idlePollFactor × PollInterval, as a safety net (rows written with the
// trigger disabled, a parked key whose time is up).
func (l *shardLoop) waitForRows(ctx context.Context) {
	wait := l.r.cfg.PollInterval
	if l.r.counters.listening.Load() {
		wait *= idlePollFactor
	}
	l.timer.Reset(wait)
	defer l.timer.Stop()
	select {
	case <-l.r.wake[l.shard]:
	case <-l.timer.C:
	case <-ctx.Done():
	}
}

// keyQueue holds a batch's unpublished rows of one key, in order.
type keyQueue struct {
	key      string
	rows     []*relayRow
	attempts int // failed publishes of rows[0] that were the message's fault
}

// flight is a publish awaiting its ack.
type flight struct {
	queue    *keyQueue
	row      *relayRow
	ack      jetstream.PubAckFuture
	deadline time.Time
	span     trace.Span // kfn.relay.publish; nil without a tracer
}

// publishBatch publishes rows and returns the ids the stream acked. It
// returns when every row is acked or belongs to a parked key, or when ctx
// ends (rows not acked by then stay in the outbox for the next owner).
func (l *shardLoop) publishBatch(ctx context.Context, rows []relayRow) []int64 {
	cfg := &l.r.cfg
	queues := map[string]*keyQueue{}
	var ready []*keyQueue // keys whose next row can be sent now
	for i := range rows {
		q := queues[rows[i].Key]
		if q == nil {
			q = &keyQueue{key: rows[i].Key}
			queues[q.key] = q
			ready = append(ready, q)
		}
		q.rows = append(q.rows, &rows[i])
	}

	var (
		inFlight    []*flight   // in publish order
		retryLater  []*keyQueue // keys with a failed publish, sent again after the pause
		pausedUntil time.Time   // zero: not paused
		acked       = make([]int64, 0, len(rows))
	)
	failed := func(q *keyQueue, row *relayRow, err error) {
		l.r.counters.failures.Add(1)
		if l.messageFault(q, row, err) {
			return // parked: the rest of the key waits for a later batch
		}
		retryLater = append(retryLater, q)
		if pausedUntil.IsZero() {
			delay := l.publishRetry.NextBackOff()
			pausedUntil = time.Now().Add(delay)
			l.log.Warn("outbox publish failed; pausing the shard", "err", err, "event_id", row.EventID, "retry_in", delay)
		}
	}

	for {
		if !pausedUntil.IsZero() && !time.Now().Before(pausedUntil) {
			pausedUntil = time.Time{}
			ready = append(ready, retryLater...)
			retryLater = retryLater[:0]
		}
		for pausedUntil.IsZero() && len(inFlight) < cfg.MaxInFlight && len(ready) > 0 && ctx.Err() == nil {
			q := ready[0]
			ready = ready[1:]
			row := q.rows[0]
			if !l.covers(ctx, row.Subject) {
				l.park(q, row, errors.New("the stream's subjects do not capture the event's subject"))
				continue
			}
			msg, dropped := buildMessage(row, cfg.Stream)
			if len(dropped) > 0 {
				l.log.Warn("dropped event headers NATS cannot carry", "event_id", row.EventID, "headers", dropped)
			}
			span := l.startPublish(row, msg)
			ack, err := cfg.JetStream.PublishMsgAsync(msg)
			if err != nil {
				endPublish(span, false, err)
				failed(q, row, err)
				continue
			}
			inFlight = append(inFlight, &flight{queue: q, row: row, ack: ack, deadline: time.Now().Add(cfg.AckTimeout), span: span})
		}

		if len(inFlight) == 0 && len(ready) == 0 && len(retryLater) == 0 {
			return acked
		}
		if ctx.Err() != nil {
			for _, f := range inFlight {
				endPublish(f.span, false, errStoppedBeforeAck)
			}
			return acked
		}

		// Wait for the oldest publish (acks come back in publish order, as
		// one connection carries them), its deadline, or the end of a pause.
		var wakeAt time.Time
		var oldest *flight
		if len(inFlight) > 0 {
			oldest = inFlight[0]
			wakeAt = oldest.deadline
		}
		if !pausedUntil.IsZero() && (wakeAt.IsZero() || pausedUntil.Before(wakeAt)) {
			wakeAt = pausedUntil
		}
		if wakeAt.IsZero() {
			continue // unreachable: with nothing in flight the shard is paused
		}
		l.timer.Reset(time.Until(wakeAt))
		var okCh <-chan *jetstream.PubAck
		var errCh <-chan error
		if oldest != nil {
			okCh, errCh = oldest.ack.Ok(), oldest.ack.Err()
		}
		select {
		case pubAck := <-okCh:
			inFlight = inFlight[1:]
			now := time.Now()
			q := oldest.queue
			q.attempts = 0
			q.rows = q.rows[1:]
			if len(q.rows) > 0 {
				ready = append(ready, q)
			}
			acked = append(acked, oldest.row.ID)
			endPublish(oldest.span, pubAck.Duplicate, nil)
			l.publishRetry.Reset()
			l.r.counters.acked(pubAck.Duplicate, oldest.row.CreatedAt, now)
			if cfg.afterAck != nil {
				cfg.afterAck(oldest.row.EventID, now)
			}
		case err := <-errCh:
			inFlight = inFlight[1:]
			if errors.Is(err, jetstream.ErrNoStreamResponse) {
				clear(l.covered) // perhaps the stream no longer captures the subject
			}
			endPublish(oldest.span, false, err)
			failed(oldest.queue, oldest.row, err)
		case <-l.timer.C:
			if oldest != nil && !time.Now().Before(oldest.deadline) {
				inFlight = inFlight[1:]
				endPublish(oldest.span, false, errAckTimeout)
				failed(oldest.queue, oldest.row, errAckTimeout)
			}
		case <-ctx.Done():
		}
		l.timer.Stop()
	}
}

// messageFault records a failed publish of row and reports whether its key
// got parked. Outages (connection loss, no stream responding, ack timeouts,
// JetStream unavailable) never park: everything waits for NATS to return.
// Errors about the message itself park the key after MaxAttempts.
func (l *shardLoop) messageFault(q *keyQueue, row *relayRow, err error) bool {
	if isOutage(err) {
		return false
	}
	q.attempts++
	if q.attempts < l.r.cfg.MaxAttempts {
		return false
	}
	l.park(q, row, err)
	return true
}

func (l *shardLoop) park(q *keyQueue, row *relayRow, reason error) {
	l.parked[q.key] = time.Now().Add(l.r.cfg.ParkFor)
	l.r.counters.parked.Add(1)
	l.log.Error("parking an outbox key: its next event cannot be published; the key's events stay in the outbox and are retried later",
		"key", q.key, "event_id", row.EventID, "subject", row.Subject, "err", reason, "retry_in", l.r.cfg.ParkFor)
}

// covers reports whether the stream captures subject, remembering yeses.
func (l *shardLoop) covers(ctx context.Context, subject string) bool {
	if l.covered[subject] {
		return true
	}
	if !l.r.streamCovers(ctx, subject) {
		return false
	}
	if len(l.covered) > 10000 {
		clear(l.covered)
	}
	l.covered[subject] = true
	return true
}

// parkedKeys drops expired parks and returns the keys still parked.
func (l *shardLoop) parkedKeys() []string {
	now := time.Now()
	maps.DeleteFunc(l.parked, func(_ string, until time.Time) bool { return !now.Before(until) })
	return slices.Collect(maps.Keys(l.parked))
}

// deleteAcked deletes acked rows, retrying while Postgres is down. If the
// shard is being stopped it makes one last short attempt; rows it cannot
// delete are published again by the next owner and dropped as duplicates.
func (l *shardLoop) deleteAcked(ctx context.Context, ids []int64) {
	for {
		err := deleteRelayed(ctx, l.r.cfg.Pool, ids)
		if err == nil {
			l.dbRetry.Reset()
			return
		}
		if ctx.Err() != nil {
			lastCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			err = deleteRelayed(lastCtx, l.r.cfg.Pool, ids)
			cancel()
			if err != nil {
				l.log.Warn("could not delete relayed outbox rows while stopping; they will be republished and deduplicated", "err", err, "rows", len(ids))
			}
			return
		}
		delay := l.dbRetry.NextBackOff()
		l.log.Warn("deleting relayed outbox rows failed; retrying", "err", err, "rows", len(ids), "retry_in", delay)
		sleepCtx(ctx, delay)
	}
}

// isOutage reports whether a publish error is about the connection or the
// server rather than the message.
func isOutage(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		return apiErr.Code >= 500
	}
	return errors.Is(err, errAckTimeout) ||
		errors.Is(err, nats.ErrDisconnected) ||
		errors.Is(err, nats.ErrConnectionClosed) ||
		errors.Is(err, nats.ErrConnectionReconnecting) ||
		errors.Is(err, nats.ErrConnectionDraining) ||
		errors.Is(err, nats.ErrNoResponders) ||
		errors.Is(err, nats.ErrTimeout) ||
		errors.Is(err, jetstream.ErrNoStreamResponse) ||
		errors.Is(err, jetstream.ErrTooManyStalledMsgs) ||
		errors.Is(err, jetstream.ErrAsyncPublishTimeout) ||
		errors.Is(err, jetstream.ErrInvalidJSAck) ||
		errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, context.Canceled)
}
