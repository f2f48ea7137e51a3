package outbox

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"maps"
	"slices"
	"strings"
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
// once), then delete the acked ones and read the next batch in one
// statement. A batch is fully settled before the next read, which is what
// lets the read go without a cursor (see selectShardBatch). The batch's
// bookkeeping lives in the loop and is reused from batch to batch.
type shardLoop struct {
	r     *Relay
	shard int
	log   *slog.Logger
	// acks sends the shard's publishes; their acks come into inbox, and
	// are taken into ackScratch.
	acks       *ackRouter
	inbox      *ackInbox
	ackScratch []ackResult

	// parked keys are skipped until the time given; their rows stay in the
	// outbox, and later rows of the key wait behind them.
	parked map[string]time.Time
	// covered caches subjects the stream was seen to capture.
	covered map[string]bool
	// publishRetry paces a shard that hit a failed publish; dbRetry paces
	// failed Postgres queries.
	publishRetry *backoff.ExponentialBackOff
	dbRetry      *backoff.ExponentialBackOff
	// readFailing and publishFailing say that the shard's last read, or
	// publish, failed: its next success ends the run of failures in the
	// relay's repeats.
	readFailing, publishFailing bool
	timer                       *time.Timer
	// lingerFor is the last wait between two reads (see linger); 0 after
	// an empty read.
	lingerFor time.Duration

	batch   batchState
	scratch readScratch
	message messageBuf
	// sources caches ce-source values by the emitting function's name.
	sources map[string]string
}

// batchState is a batch being published: its rows, per key a queue of
// them (linked through next, in id order), and the publishes in flight.
type batchState struct {
	rows       []relayRow
	next       []int32          // next[i]: the next row of row i's key, or -1
	queueOf    map[string]int32 // key → index in queues
	queues     []keyQueue
	ready      []int32 // queues whose next row can be sent now
	retryLater []int32 // queues with a failed publish, sent again after the pause
	tails      []int32 // per queue, its last row, while the queues are built
	flights    []flight
	oldest     int // flights[oldest:] are in flight, in publish order
	acked      []int64
}

func (b *batchState) reset(rows []relayRow) {
	b.rows = rows
	b.next = slices.Grow(b.next[:0], len(rows))[:len(rows)]
	if b.queueOf == nil {
		b.queueOf = map[string]int32{}
	}
	clear(b.queueOf)
	b.queues, b.ready, b.retryLater = b.queues[:0], b.ready[:0], b.retryLater[:0]
	clear(b.flights) // drop the references to the last batch's futures
	b.flights, b.oldest, b.acked, b.tails = b.flights[:0], 0, b.acked[:0], b.tails[:0]
	for i := range rows {
		b.next[i] = -1
		q, ok := b.queueOf[rows[i].Key]
		if !ok {
			q = int32(len(b.queues))
			b.queueOf[rows[i].Key] = q
			b.queues = append(b.queues, keyQueue{key: rows[i].Key, head: int32(i)})
			b.tails = append(b.tails, int32(i))
			b.ready = append(b.ready, q)
			continue
		}
		b.next[b.tails[q]] = int32(i)
		b.tails[q] = int32(i)
	}
}

func newShardLoop(r *Relay, shard int, acks *ackRouter) *shardLoop {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return &shardLoop{
		r:            r,
		shard:        shard,
		acks:         acks,
		inbox:        &acks.inbox[shard],
		log:          r.log.With("shard", shard),
		parked:       map[string]time.Time{},
		covered:      map[string]bool{},
		publishRetry: r.newBackoff(),
		dbRetry:      r.newBackoff(),
		timer:        t,
		sources:      map[string]string{},
	}
}

func (l *shardLoop) run(ctx context.Context) {
	defer l.timer.Stop()
	var acked []int64 // relayed rows not deleted yet: the next read deletes them
	for ctx.Err() == nil {
		rows, err := readBatch(ctx, l.r.cfg.Pool, l.shard, l.parkedKeys(), l.r.cfg.BatchSize, acked, l.batch.rows[:0], &l.scratch)
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			delay := l.dbRetry.NextBackOff()
			l.r.repeats.Failed(ctx, l.log, slog.LevelWarn, readFailed, "err", err, "retry_in", delay)
			l.readFailing = true
			sleepCtx(ctx, delay)
			continue
		}
		if l.readFailing {
			l.readFailing = false
			l.r.repeats.Over(ctx, l.log, readFailed)
		}
		l.dbRetry.Reset()
		acked = nil
		if len(rows) == 0 {
			l.batch.rows = rows
			l.lingerFor = 0 // idle: the next rows are read as soon as they are notified
			l.waitForRows(ctx)
			continue
		}
		acked = l.publishBatch(ctx, rows)
		if len(rows) < l.r.cfg.BatchSize {
			l.linger(ctx)
		}
	}
	l.deleteWhileStopping(ctx, acked)
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

// linger waits after a batch that was not full before the next read, so
// that rows committing meanwhile come in one read rather than one read
// each: at a steady rate a shard reads at most once per linger plus a
// publish round, instead of once per notifying commit. The wait starts at
// Linger and doubles while the shard keeps finding rows, up to MaxLinger:
// a shard under a steady flow reads fewer, bigger batches (each read costs
// the relay about as much CPU as relaying a few events), while a shard
// that sees one commit now and then waits only Linger. An idle shard that
// a notification wakes reads at once.
func (l *shardLoop) linger(ctx context.Context) {
	l.lingerFor = nextLinger(l.lingerFor, l.r.cfg.Linger, l.r.cfg.MaxLinger)
	if l.lingerFor <= 0 {
		return
	}
	l.timer.Reset(l.lingerFor)
	select {
	case <-l.timer.C:
	case <-ctx.Done():
	}
	l.timer.Stop()
}

// nextLinger is the wait after a batch that was not full, given the last
// one (0 after an empty read): first base, then twice the last, up to most.
func nextLinger(last, base, most time.Duration) time.Duration {
	if base <= 0 {
		return 0
	}
	if last <= 0 {
		return base
	}
	return min(2*last, most)
}

// keyQueue holds a batch's unpublished rows of one key: head is the first,
// the others follow through batchState.next.
type keyQueue struct {
	key      string
	head     int32
	attempts int // failed publishes of the head row that were the message's fault
}

// flight is a publish awaiting its ack: seq is its reply sequence, and
// settled says the ack (duplicate) or the failure (err) came in.
type flight struct {
	queue     int32
	row       int32
	seq       uint64
	settled   bool
	duplicate bool
	err       error
	deadline  time.Time
	span      trace.Span // "send <subject>"; nil without a tracer
}

// publishBatch publishes rows and returns the ids the stream acked. It
// returns when every row is acked or belongs to a parked key, or when ctx
// ends (rows not acked by then stay in the outbox for the next owner).
func (l *shardLoop) publishBatch(ctx context.Context, rows []relayRow) []int64 {
	cfg := &l.r.cfg
	b := &l.batch
	b.reset(rows)
	var pausedUntil time.Time // zero: not paused
	failed := func(q int32, row int32, err error) {
		l.r.counters.failures.Add(1)
		if l.messageFault(&b.queues[q], &rows[row], err) {
			return // parked: the rest of the key waits for a later batch
		}
		b.retryLater = append(b.retryLater, q)
		if pausedUntil.IsZero() {
			delay := l.publishRetry.NextBackOff()
			pausedUntil = time.Now().Add(delay)
			l.r.repeats.Failed(ctx, l.log, slog.LevelWarn, publishFailed, "err", err, "event_id", rows[row].EventID, "retry_in", delay)
			l.publishFailing = true
		}
	}

	for {
		if !pausedUntil.IsZero() && !time.Now().Before(pausedUntil) {
			pausedUntil = time.Time{}
			b.ready = append(b.ready, b.retryLater...)
			b.retryLater = b.retryLater[:0]
		}
		for pausedUntil.IsZero() && len(b.flights)-b.oldest < cfg.MaxInFlight && len(b.ready) > 0 && ctx.Err() == nil {
			q := b.ready[0]
			b.ready = b.ready[1:]
			row := b.queues[q].head
			if !l.covers(ctx, rows[row].Subject) {
				l.park(&b.queues[q], &rows[row], errors.New("the stream's subjects do not capture the event's subject"))
				continue
			}
			msg, dropped := buildMessage(&rows[row], cfg.Stream, l.source(rows[row].Source), &l.message)
			if len(dropped) > 0 {
				l.log.Warn("dropped event headers NATS cannot carry", "event_id", rows[row].EventID, "headers", dropped)
			}
			span := l.startPublish(&rows[row], msg)
			seq, err := l.acks.send(l.shard, msg)
			if err != nil {
				endPublish(span, false, err)
				failed(q, row, err)
				continue
			}
			b.flights = append(b.flights, flight{queue: q, row: row, seq: seq, deadline: time.Now().Add(cfg.AckTimeout), span: span})
		}

		inFlight := len(b.flights) - b.oldest
		if inFlight == 0 && len(b.ready) == 0 && len(b.retryLater) == 0 {
			return b.acked
		}
		if ctx.Err() != nil {
			for _, f := range b.flights[b.oldest:] {
				endPublish(f.span, false, errStoppedBeforeAck)
			}
			return b.acked
		}

		// Wait for the oldest publish (acks come back in publish order, as
		// one connection carries them), its deadline, or the end of a pause.
		var wakeAt time.Time
		var oldest *flight
		if inFlight > 0 {
			l.takeAcks()
			oldest = &b.flights[b.oldest]
			wakeAt = oldest.deadline
		}
		if !pausedUntil.IsZero() && (wakeAt.IsZero() || pausedUntil.Before(wakeAt)) {
			wakeAt = pausedUntil
		}
		if wakeAt.IsZero() {
			continue // unreachable: with nothing in flight the shard is paused
		}
		// An ack that is already in needs no timer.
		timedOut := false
		if oldest == nil || !oldest.settled {
			l.timer.Reset(time.Until(wakeAt))
			select {
			case <-l.inbox.ready:
				l.takeAcks()
			case <-l.timer.C:
				timedOut = true
			case <-ctx.Done():
			}
			l.timer.Stop()
		}
		switch {
		case oldest != nil && oldest.settled && oldest.err == nil:
			f := l.popFlight()
			now := time.Now()
			q := &b.queues[f.queue]
			q.attempts = 0
			if q.head = b.next[f.row]; q.head >= 0 {
				b.ready = append(b.ready, f.queue)
			}
			row := &rows[f.row]
			b.acked = append(b.acked, row.ID)
			endPublish(f.span, f.duplicate, nil)
			l.publishRetry.Reset()
			if l.publishFailing {
				l.publishFailing = false
				l.r.repeats.Over(ctx, l.log, publishFailed)
			}
			l.r.counters.acked(f.duplicate, row.CreatedAt, now)
			if cfg.AfterAck != nil {
				cfg.AfterAck(row.EventID, now)
			}
		case oldest != nil && oldest.settled:
			f := l.popFlight()
			if errors.Is(f.err, jetstream.ErrNoStreamResponse) {
				clear(l.covered) // perhaps the stream no longer captures the subject
			}
			endPublish(f.span, false, f.err)
			failed(f.queue, f.row, f.err)
		case timedOut && oldest != nil && !time.Now().Before(oldest.deadline):
			f := l.popFlight()
			endPublish(f.span, false, errAckTimeout)
			failed(f.queue, f.row, errAckTimeout)
		}
	}
}

// takeAcks settles the flights whose acks came in. Acks of publishes no
// longer in flight (timed out and sent again, or of an earlier loop of the
// shard) are dropped.
func (l *shardLoop) takeAcks() {
	got := l.inbox.take(l.ackScratch)
	flying := l.batch.flights[l.batch.oldest:]
	for _, a := range got {
		if a.lost {
			for i := range flying {
				if f := &flying[i]; !f.settled && f.seq <= a.seq {
					f.settled, f.err = true, a.err
				}
			}
			continue
		}
		i, found := slices.BinarySearchFunc(flying, a.seq, func(f flight, seq uint64) int { return cmp.Compare(f.seq, seq) })
		if found && !flying[i].settled {
			flying[i].settled, flying[i].duplicate, flying[i].err = true, a.duplicate, a.err
		}
	}
	clear(got) // drop the errors
	l.ackScratch = got[:0]
}

// popFlight removes the oldest flight, which has been settled, and
// returns it.
func (l *shardLoop) popFlight() flight {
	b := &l.batch
	f := b.flights[b.oldest]
	b.flights[b.oldest] = flight{}
	b.oldest++
	if b.oldest == len(b.flights) {
		b.flights, b.oldest = b.flights[:0], 0
	}
	return f
}

// source returns the ce-source of events emitted by function fn.
func (l *shardLoop) source(fn string) string {
	s, ok := l.sources[fn]
	if !ok {
		if len(l.sources) > 1000 {
			clear(l.sources)
		}
		s = CloudEventsSourcePrefix + fn
		l.sources[strings.Clone(fn)] = s
	}
	return s
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
	l.parked[strings.Clone(q.key)] = time.Now().Add(l.r.cfg.ParkFor)
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
	l.covered[strings.Clone(subject)] = true
	return true
}

// parkedKeys drops expired parks and returns the keys still parked.
func (l *shardLoop) parkedKeys() []string {
	now := time.Now()
	maps.DeleteFunc(l.parked, func(_ string, until time.Time) bool { return !now.Before(until) })
	return slices.Collect(maps.Keys(l.parked))
}

// deleteWhileStopping makes one last short attempt to delete the rows the
// shard relayed but could not delete with its next read, as it stops. Rows
// it cannot delete are published again by the next owner and dropped as
// duplicates.
func (l *shardLoop) deleteWhileStopping(ctx context.Context, ids []int64) {
	if len(ids) == 0 {
		return
	}
	lastCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	if err := deleteRelayed(lastCtx, l.r.cfg.Pool, ids); err != nil {
		l.r.repeats.Failed(ctx, l.log, slog.LevelWarn, deleteWhileStopping, "err", err, "rows", len(ids))
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
