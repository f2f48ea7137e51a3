package engine

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/faults"
	"github.com/kfn-dev/kfn/internal/naming"
	"github.com/kfn-dev/kfn/outbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// subjectRun is one lane of a NATS-triggered function: a durable JetStream
// consumer of the function's subject, read in batches in stream order. The
// lane applies the events whose key hashes to it (outbox.LaneOf), each
// batch in one fenced Postgres transaction, and skips the others, which
// belong to other lanes. A batch is acked (AckAll, up to its last event)
// only after it commits.
type subjectRun struct {
	*applier
	w      *worker
	stream string
	lane   int
	lanes  int
	start  int64      // the lane's cursor when claimed: no event of it below is unhandled
	retry  *retryLane // dead letters marked for retry (retry_lane.go)
	// keyLanes are the lane's key-lanes' appliers (KeyConcurrency > 1),
	// made at the first batch; none for one lane.
	keyLanes []*applier
	// delivered is the consumer sequence of the last event the lane's
	// consumer delivered to it (0: none yet).
	delivered uint64
}

// ackWait is how long JetStream waits for an ack before redelivering. It
// covers a batch with its retries; a redelivery is skipped by the inbox.
const ackWait = 2 * time.Minute

func (sr *subjectRun) run(ctx context.Context) error {
	var cons jetstream.Consumer
	err := retryInfra(ctx, sr.repeats, sr.log, "claim subject", func(ctx context.Context) error {
		cur, err := inbox.ClaimLane(ctx, sr.w.pool, sr.part, sr.lanes, sr.token, sr.w.cfg.WorkerID, sr.w.startedAt, sr.w.keyConcurrency(sr.fn), sr.w.cfg.LeaseRenew)
		var stale *inbox.LaneCountError
		if errors.As(err, &stale) {
			return backoff.Permanent(err) // this worker's configuration is out of date
		}
		if err != nil {
			sr.w.claimBlocked(sr.fn.Name, sr.log, err)
			return err
		}
		sr.generation, sr.start = cur.Generation, cur.NextOffset
		cons, err = sr.newTermConsumer(ctx)
		return err
	})
	if err != nil {
		return err
	}
	sr.log.Debug("subject lane claimed", "next_seq", sr.start)
	msgs, err := sr.consume(cons)
	if err != nil {
		return err
	}
	defer func() { msgs.Stop() }()
	for {
		if err := sr.retry.applyPending(ctx); err != nil {
			return err
		}
		batch, err := sr.fetch(ctx, msgs)
		if errors.Is(err, errRetryWake) {
			continue
		}
		lost := errors.Is(err, errDeliveryLost)
		if err != nil && !lost {
			return err
		}
		recs := make([]kfn.Record, 0, len(batch))
		for _, m := range batch {
			if rec := eventRecord(m, sr.stream); outbox.LaneOf(rec.Key, sr.lanes) == sr.lane {
				recs = append(recs, rec)
			}
		}
		if len(recs) > 0 {
			if err := sr.applyBatch(ctx, recs); err != nil {
				return err // not acked: JetStream redelivers, the inbox skips what committed
			}
		}
		if len(batch) > 0 {
			// AckAll: this acks every event of the batch, the skipped ones too.
			if err := batch[len(batch)-1].Ack(); err != nil {
				sr.log.Debug("ack failed; the events will be redelivered and skipped", "err", err)
			}
		}
		if lost {
			// The events after the gap are not acked: a new consumer
			// delivers them again, from the last ack on.
			sr.log.Warn("an event the lane's consumer delivered never reached the lane (lost in flight when a NATS server went away); the lane's consumer starts again after its last ack",
				"delivered", sr.delivered)
			msgs.Stop()
			if err := retryInfra(ctx, sr.repeats, sr.log, "restart subject consumer", func(ctx context.Context) error {
				cons, err = sr.newTermConsumer(ctx)
				return err
			}); err != nil {
				return err
			}
			next, err := sr.consume(cons)
			if err != nil {
				return err
			}
			msgs = next
		}
	}
}

// errDeliveryLost: the consumer sequence of a delivery skipped one or more
// deliveries, which JetStream counts as delivered but the lane never got.
var errDeliveryLost = errors.New("a delivery of the lane's consumer was lost")

// pullExpiry is how long one pull request of a lane waits on the server.
// nats.go's Messages sends heartbeats every half of it and ends with
// ErrNoHeartbeat (the lane stops and is run again) when two are missed: a
// pull request lost with a NATS node, or sent before a new consumer's
// leader was ready, then costs seconds, not the 30 s default's.
const pullExpiry = 5 * time.Second

// consume starts reading cons, a consumer this lane just created.
func (sr *subjectRun) consume(cons jetstream.Consumer) (jetstream.MessagesContext, error) {
	sr.delivered = 0
	msgs, err := cons.Messages(jetstream.PullMaxMessages(2*sr.w.cfg.BatchSize), jetstream.PullExpiry(pullExpiry))
	if err != nil {
		return nil, fmt.Errorf("consume %s: %w", sr.fn.Subject, err)
	}
	return msgs, nil
}

// inSequence reports whether m is the delivery after the previous one the
// lane got. A delivery in flight when a NATS server on its way went down
// (the client's server, or the consumer leader's) is lost without a word:
// the client reconnects and pulls on, and JetStream, which counts the event
// as delivered, sends the next ones. The lane acks with AckAll, so acking a
// later event would ack the lost one unhandled, and it would never be
// delivered again. Every delivery, a redelivery too, takes the consumer's
// next delivery sequence, so a lost one shows as a gap. A sequence at or
// below the previous one (a new consumer leader that resumes from its
// replicated state) only delivers events again, which the inbox skips.
func (sr *subjectRun) inSequence(m jetstream.Msg) bool {
	md, err := m.Metadata()
	if err != nil {
		return true // not a JetStream delivery: there is no sequence to check
	}
	if md.Sequence.Consumer > sr.delivered+1 {
		return false
	}
	sr.delivered = md.Sequence.Consumer
	return true
}

// newTermConsumer starts this ownership term's durable consumer where the
// previous term's acks ended, or at the lane's cursor if that is further
// (both are points below which no event of the lane is unhandled; a lane
// created by a change of the lane count has only its cursor). Recreating
// the consumer, rather than reusing it, hands over at once the events the
// previous owner fetched but never acked (it may have died): a reused
// consumer would hold them back for AckWait. Events after the start that
// were applied are delivered again and skipped by the inbox; a zombie still
// pulling from the old consumer is fenced in Postgres.
func (sr *subjectRun) newTermConsumer(ctx context.Context) (jetstream.Consumer, error) {
	name := naming.LaneConsumer(sr.fn.Name, sr.lane, sr.lanes)
	cfg := jetstream.ConsumerConfig{
		Durable:       name,
		FilterSubject: sr.fn.Subject,
		AckPolicy:     jetstream.AckAllPolicy,
		AckWait:       ackWait,
		MaxAckPending: 2 * sr.w.cfg.BatchSize,
		DeliverPolicy: jetstream.DeliverAllPolicy,
	}
	start := uint64(max(sr.start, 0))
	old, err := sr.w.js.Consumer(ctx, sr.stream, name)
	switch {
	case err == nil:
		info, err := old.Info(ctx)
		if err != nil {
			return nil, fmt.Errorf("read consumer %s on stream %s: %w", name, sr.stream, err)
		}
		start = max(start, info.AckFloor.Stream+1)
		if err := sr.w.js.DeleteConsumer(ctx, sr.stream, name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
			return nil, fmt.Errorf("replace consumer %s on stream %s: %w", name, sr.stream, err)
		}
	case !errors.Is(err, jetstream.ErrConsumerNotFound):
		return nil, fmt.Errorf("look up consumer %s on stream %s: %w", name, sr.stream, err)
	}
	if err != nil && start > 1 && !sr.cursorFitsStream(ctx, start) {
		start = 0
	}
	if start > 1 {
		cfg.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		cfg.OptStartSeq = start
	}
	cons, err := sr.w.js.CreateConsumer(ctx, sr.stream, cfg)
	if err != nil {
		return nil, fmt.Errorf("durable consumer %s on stream %s: %w", name, sr.stream, err)
	}
	return cons, nil
}

// cursorFitsStream reports whether the lane's cursor, start, counts in the
// stream as it is now. A stream deleted and created again numbers its
// events from 1 anew, and its consumers are gone with it: a cursor last
// moved before the stream was created, or beyond its last event, belongs
// to the old stream, and the lane reads the new one from its start (the
// event inbox skips what was applied).
func (sr *subjectRun) cursorFitsStream(ctx context.Context, start uint64) bool {
	stream, err := sr.w.js.Stream(ctx, sr.stream)
	if err != nil {
		sr.log.Warn("cannot read the stream; the lane reads it from its start", "err", err)
		return false
	}
	info := stream.CachedInfo()
	movedAt, err := inbox.LaneMovedAt(ctx, sr.w.pool, sr.part)
	fits := err == nil && movedAt.After(info.Created) && start <= info.State.LastSeq+1
	if !fits {
		sr.log.Warn("the lane's cursor does not belong to the stream as it is now (created again?); the lane reads it from its start",
			"next_seq", start, "stream_created", info.Created, "stream_last_seq", info.State.LastSeq, "cursor_moved", movedAt, "err", err)
	}
	return fits
}

// fetch blocks for the first event, then gathers more until the batch is full
// (BatchSize events, or events of BatchMaxBytes, the last one taking it
// there) or BatchWait has passed since the first one. It ends the batch before a
// delivery that follows a lost one, with errDeliveryLost.
func (sr *subjectRun) fetch(ctx context.Context, msgs jetstream.MessagesContext) ([]jetstream.Msg, error) {
	wctx, stop := sr.retry.waitContext(ctx)
	first, err := msgs.Next(jetstream.NextContext(wctx))
	stop()
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if wokenForRetry(wctx) {
			return nil, errRetryWake
		}
		return nil, fmt.Errorf("read %s: %w", sr.fn.Subject, err)
	}
	if !sr.inSequence(first) {
		return nil, errDeliveryLost
	}
	batch := []jetstream.Msg{first}
	bytes := msgSize(first)
	deadline := time.Now().Add(sr.w.cfg.BatchWait)
	for len(batch) < sr.w.cfg.BatchSize && bytes < sr.w.cfg.BatchMaxBytes {
		wait := time.Until(deadline)
		if wait <= 0 {
			break
		}
		fctx, cancel := context.WithTimeout(ctx, wait)
		m, err := msgs.Next(jetstream.NextContext(fctx))
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			break
		}
		if !sr.inSequence(m) {
			return batch, errDeliveryLost
		}
		batch = append(batch, m)
		bytes += msgSize(m)
	}
	return batch, nil
}

// msgSize is an event's bytes as a batch counts them: its data and headers
// (recordSize of its record, without building it).
func msgSize(m jetstream.Msg) int {
	n := len(m.Data())
	for k, vs := range m.Headers() {
		for _, v := range vs {
			n += len(k) + len(v)
		}
	}
	return n
}

// eventRecord turns a JetStream message into a Record. An event without a
// Nats-Msg-Id (not published by a kfn relay) is identified by its stream
// position, which is stable across redeliveries.
func eventRecord(m jetstream.Msg, stream string) kfn.Record {
	var seq int64
	if md, err := m.Metadata(); err == nil {
		seq = int64(md.Sequence.Stream)
	}
	h := m.Headers()
	rec := kfn.Record{Topic: m.Subject(), Offset: seq, Value: m.Data(), EventID: naming.EventID(h, stream, seq), Key: naming.EventKey(h)}
	if t, err := time.Parse(time.RFC3339Nano, h.Get(outbox.HeaderTime)); err == nil {
		rec.Time = t
	}
	for k, vs := range h {
		for _, v := range vs {
			rec.Headers = append(rec.Headers, kfn.Header{Key: k, Value: []byte(v)})
		}
	}
	return rec
}

// subjectTracker fences a JetStream lane through its cursor row (used as a
// fence and a progress marker) and dedups by event id. The tracker of one
// of the lane's key-lanes (keyLanes set) fences through its key-lane's
// row instead, and leaves the cursor to the lane.
type subjectTracker struct {
	consumer string
	part     inbox.Partition
	token    int64
	keyLanes bool
	keyLane  int
}

func (l *subjectTracker) fence(ctx context.Context, tx pgx.Tx, rec kfn.Record) error {
	return l.fenceAt(ctx, tx, rec.Offset)
}

// fenceAt fences tx under the lane's token and moves its progress marker
// to seq.
func (l *subjectTracker) fenceAt(ctx context.Context, tx pgx.Tx, seq int64) error {
	faults.Lane(faults.BeforeFence, l.part, l.token)
	var err error
	if l.keyLanes {
		err = inbox.FenceKeyLane(ctx, tx, l.part, l.keyLane, l.token, seq+1)
	} else {
		err = inbox.Fence(ctx, tx, l.part, l.token, seq)
	}
	switch {
	case err == nil:
		faults.Lane(faults.AfterFence, l.part, l.token)
	case errors.Is(err, inbox.ErrFenced):
		faults.Lane(faults.FenceRefused, l.part, l.token)
	}
	return err
}

func (l *subjectTracker) claim(ctx context.Context, tx pgx.Tx, recs []kfn.Record) ([]kfn.Record, error) {
	last := recs[0].Offset
	refs := make([]inbox.EventRef, len(recs))
	for i, r := range recs {
		refs[i] = inbox.EventRef{ID: r.EventID, Subject: r.Topic, StreamSeq: r.Offset}
		last = max(last, r.Offset)
	}
	if err := l.fenceAt(ctx, tx, last); err != nil {
		return nil, err
	}
	freshIDs, err := inbox.ClaimEvents(ctx, tx, l.consumer, l.token, inbox.Applied, refs)
	if err != nil {
		return nil, err
	}
	fresh := make([]kfn.Record, 0, len(freshIDs))
	for _, r := range recs {
		if freshIDs[r.EventID] {
			fresh = append(fresh, r)
			delete(freshIDs, r.EventID) // one event twice in a batch applies once
		}
	}
	return fresh, nil
}

func (l *subjectTracker) markDeadLettered(ctx context.Context, tx pgx.Tx, rec kfn.Record) error {
	return inbox.MarkEventDeadLettered(ctx, tx, l.consumer, l.token, inbox.EventRef{ID: rec.EventID, Subject: rec.Topic, StreamSeq: rec.Offset})
}

func (l *subjectTracker) committed(kfn.Record) {}

func (l *subjectTracker) cursorAfter(rec kfn.Record) int64 { return rec.Offset + 1 }
