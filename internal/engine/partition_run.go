package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/kafkasource"
	"github.com/kfn-dev/kfn/internal/observe"
	"github.com/kfn-dev/kfn/internal/repeatlog"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// partitionRun is one owned partition: claimed in Postgres with a fencing
// token, read from Kafka at the Postgres cursor, applied batch by batch.
type partitionRun struct {
	*applier
	w      *worker
	cursor *partitionTracker
	lane   cursorLane // the cursor, or the benchmark's baseline wrapping it
	retry  *retryLane // dead letters marked for retry (retry_lane.go)
	// filled is set once fetch has read a batch; only fetch, which runs
	// once at a time, uses it.
	filled bool
}

// cursorLane is the tracker of a Kafka partition: it also moves the
// cursor over offsets that hold no committed record.
type cursorLane interface {
	tracker
	// pass fences tx for moving the cursor to `to` without a record.
	pass(ctx context.Context, tx pgx.Tx, to int64) error
	// passed moves the in-memory cursor to `to` after pass committed.
	passed(to int64)
}

func (pr *partitionRun) run(ctx context.Context) error {
	began := time.Now()
	if err := retryInfra(ctx, pr.repeats, pr.log, "claim partition", pr.claim); err != nil {
		return err
	}
	pr.log.Debug("partition claimed", "next_offset", pr.cursor.next, "took", time.Since(began))
	pr.w.start.phase(phaseFence, began)
	if k := pr.w.keyConcurrency(pr.fn); k > 1 {
		keys := pr.newKeyLaneRun(k)
		lanesCtx, wait := keys.start(ctx)
		err := pr.read(lanesCtx, keys)
		if kerr := wait(); kerr != nil {
			return kerr // a key-lane fenced, say: the reader only saw its context end
		}
		return err
	}
	return pr.read(ctx, nil)
}

// read reads the partition from its cursor and applies its records: batch
// by batch, or, with keys, through the partition's key-lanes.
func (pr *partitionRun) read(ctx context.Context, keys *keyLaneRun) error {
	began := time.Now()
	reader, err := pr.w.kafka.Reader(pr.part.Topic, pr.part.Partition, pr.cursor.next)
	if err != nil {
		return err
	}
	// Closing a reader waits for its fetch in flight (up to its MaxWait);
	// the lease is not held for that: the reader touches nothing the next
	// owner uses. Run waits for the close.
	defer func() { pr.w.readersClosing.Go(func() { reader.Close() }) }()
	// The next batch is read while the current one commits: a prefetch
	// runs in its own goroutine, one at a time, on the lane's reader.
	prefetchCtx, stopPrefetch := context.WithCancel(ctx)
	var next <-chan fetched
	defer func() {
		stopPrefetch()
		if next != nil {
			<-next // before the reader closes
		}
	}()

	outage := newKafkaOutage(pr.log, pr.repeats)
	for {
		if err := pr.applyRetries(ctx, keys); err != nil {
			return err
		}
		if next == nil {
			reader.NoteCursor(keys.cursor(pr))
			next = pr.prefetch(prefetchCtx, reader)
		}
		f := <-next
		next = nil
		batch, err := f.batch, f.err
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if errors.Is(err, errRetryWake) {
				continue
			}
			// The broker is unreachable or the reader failed. That is no
			// reason to give the partition up: its lease stays (this
			// worker is healthy), and another owner could not read either.
			// Wait, then read again from the cursor with a new reader.
			if err := outage.wait(ctx, err); err != nil {
				return err
			}
			// With key-lanes, the new reader starts past every dispatched
			// record.
			if err := keys.drain(ctx); err != nil {
				return err
			}
			keys.drained()
			reader.Close()
			if reader, err = pr.w.kafka.Reader(pr.part.Topic, pr.part.Partition, pr.cursor.next); err != nil {
				return err
			}
			continue
		}
		outage.over()
		if len(batch) > 0 {
			pr.w.start.phase(phaseFetch, began)
		}
		if len(batch) == 0 {
			if err := keys.drain(ctx); err != nil {
				return err
			}
			err := pr.passOver(ctx, f.passed, f.lagEnd)
			keys.drained()
			if err != nil {
				return err
			}
			continue
		}
		if keys != nil {
			next = pr.prefetch(prefetchCtx, reader)
			if err := pr.dispatch(ctx, keys, f); err != nil {
				return err
			}
			continue
		}
		// A commit whose reply was lost may have moved the cursor past
		// records read before the lane knew.
		if batch = uncommitted(batch, pr.cursor.next); len(batch) == 0 {
			continue
		}
		next = pr.prefetch(prefetchCtx, reader)
		if err := pr.applyBatch(ctx, batch, f.afters); err != nil {
			return err
		}
	}
}

// applyBatch applies a batch read at the cursor, one or more transactions
// at a time. The records read before an expiry are applied before it is
// skipped: the batch goes in one or more parts, each checked at the cursor
// its predecessor left.
func (pr *partitionRun) applyBatch(ctx context.Context, batch []kfn.Record, afters map[int64]int64) error {
	pr.cursor.afters = afters
	for ; len(batch) > 0; batch = uncommitted(batch, pr.cursor.next) {
		cut := len(batch)
		err := retryInfra(ctx, pr.repeats, pr.log, "check for expired records", func(ctx context.Context) error {
			var err error
			cut, err = pr.skipGap(ctx, batch)
			return err
		})
		if err != nil {
			return err
		}
		part := batch[:cut]
		batch = batch[cut:]
		if len(part) == 0 {
			continue
		}
		err = retryInfra(ctx, pr.repeats, pr.log, "apply batch", func(ctx context.Context) error {
			done, err := pr.apply(ctx, part)
			part = uncommitted(part[done:], pr.cursor.next)
			return err
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// claim records the token in Postgres and loads the cursor. A partition
// without a cursor starts at the configured end of the topic.
func (pr *partitionRun) claim(ctx context.Context) error {
	first, high, err := pr.w.kafka.OffsetRange(ctx, pr.part.Topic, pr.part.Partition)
	if err != nil {
		return err
	}
	start := first
	if pr.w.cfg.StartFrom == "latest" {
		start = high
	}
	cur, err := inbox.TakeOver(ctx, pr.w.pool, pr.part, pr.token, pr.w.cfg.WorkerID, start, pr.w.keyConcurrency(pr.fn), pr.w.cfg.LeaseRenew)
	if err != nil {
		pr.w.claimBlocked(pr.fn.Name, pr.log, err)
		return err
	}
	pr.cursor.next, pr.cursor.highWater, pr.generation = cur.NextOffset, cur.HighWater, cur.Generation
	if pr.cursor.next > high {
		// Reading past the high watermark never returns; the topic was
		// probably deleted and recreated. Moving the cursor is the
		// operator's call (kfn replay), so wait for it.
		return fmt.Errorf("cursor %d is past the partition's high watermark %d (was the topic recreated?): move it with kfn replay", pr.cursor.next, high)
	}
	if pr.cursor.next < first {
		if err := pr.skipExpired(ctx, first); err != nil {
			return err
		}
	}
	pr.w.stats.Update(pr.fn.Name, pr.part.Topic, pr.part.Partition, func(p *observe.PartitionStats) {
		p.Epoch, p.NextOffset, p.HighWater = pr.token, pr.cursor.next, high
	})
	// Mirror the cursor to Kafka's consumer group at once: an earlier owner
	// killed before its mirror flush may have applied every record there
	// is, and without a new commit nothing else would bring the group up to
	// the cursor.
	pr.cursor.onCommit(pr.cursor.next)
	// The keys parked by earlier owners (KeyOrder ParkKey). Only the owner
	// parks keys, so from here on the lane's memory holds every one.
	return pr.reloadHeld(ctx)
}

// skipExpired moves the cursor to `to` over records Kafka deleted
// (retention) before anyone handled them: they cannot be read any more, so
// it says so loudly, records the skip in the audit log under the lane's
// token, and the lane resumes at `to`. The claim and the batch loop
// (skipGap) both skip through here.
func (pr *partitionRun) skipExpired(ctx context.Context, to int64) error {
	from := pr.cursor.next
	pr.log.Error("records expired from Kafka before they were handled: skipping them", "from", from, "to", to, "count", to-from)
	err := pr.w.withTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
		return inbox.SkipExpired(ctx, tx, pr.part, pr.token, from, to)
	})
	if err != nil {
		return pr.cursor.fenced(err)
	}
	pr.cursor.next, pr.cursor.highWater = to, max(pr.cursor.highWater, to)
	return nil
}

// skipGap checks a batch with a gap: before its first record, or between
// two. The lane's reader, asked for an offset Kafka has deleted, jumps to
// the first one it still holds (outOfRange), so records that expired
// while the lane was behind would be passed over unnoticed. A gap can be
// legitimate (compaction, transaction markers, the records of aborted
// transactions), so only a cursor below the partition's first offset is
// an expiry; only a batch with a gap pays the round trip to Kafka. It
// returns how many of the batch's records to apply now; the rest is
// checked again after them.
func (pr *partitionRun) skipGap(ctx context.Context, batch []kfn.Record) (int, error) {
	if !gapped(batch, pr.cursor.next, pr.cursor.cursorAfter) {
		return len(batch), nil
	}
	first, _, err := pr.w.kafka.OffsetRange(ctx, pr.part.Topic, pr.part.Partition)
	if err != nil {
		return 0, err
	}
	cut, to := expired(batch, pr.cursor.next, first)
	if to > pr.cursor.next {
		return cut, pr.skipExpired(ctx, to)
	}
	return cut, nil
}

// gapped says whether batch, read at cursor next, skips an offset that
// the reader did not find empty of committed records (after, as
// partitionTracker.cursorAfter).
func gapped(batch []kfn.Record, next int64, after func(kfn.Record) int64) bool {
	for _, r := range batch {
		if r.Offset != next {
			return true
		}
		next = after(r)
	}
	return false
}

// expired decides for a batch read at cursor next from a partition whose
// first offset is now first. A cursor at or above first means nothing
// expired: the gaps are legitimate, and the whole batch is applied (cut is
// its length, to is next). Below first, every missing offset is gone for
// good: a batch that starts above the cursor skips to its first record or
// to first, whichever is lower (to), and nothing is applied before the
// batch is checked again (cut 0); otherwise the records read before the
// expiry, from the cursor on, without a gap and below first, are applied
// first (cut of them), and the rest is checked after them.
func expired(batch []kfn.Record, next, first int64) (cut int, to int64) {
	if next >= first {
		return len(batch), next
	}
	if batch[0].Offset > next {
		return 0, min(first, batch[0].Offset)
	}
	for cut < len(batch) && batch[cut].Offset == next+int64(cut) && batch[cut].Offset < first {
		cut++
	}
	return cut, next
}

// passOver moves the cursor to `to` over offsets that hold no committed
// record, when the reader found only those after it (kafkasource.ErrPassedOnly): a
// partition whose producer's last transaction ended with its marker, or
// was aborted, otherwise keeps its cursor, and its lag, one marker or an
// aborted transaction short of the end for good. The move is a fenced
// transaction of its own, claiming no inbox row; it runs only when no
// record followed within BatchWait (one that does carries the cursor past
// them in its own batch's commit), so a steady stream of transactions
// costs none.
func (pr *partitionRun) passOver(ctx context.Context, to, lagEnd int64) error {
	if to <= pr.cursor.next {
		return nil
	}
	err := retryInfra(ctx, pr.repeats, pr.log, "move the cursor past transaction markers", func(ctx context.Context) error {
		if to <= pr.cursor.next { // a commit whose reply was lost got there
			return nil
		}
		return pr.w.withTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
			return pr.lane.pass(ctx, tx, to)
		})
	})
	if err != nil {
		return pr.cursor.fenced(err)
	}
	pr.lane.passed(to)
	pr.log.Debug("cursor moved past offsets without a committed record", "next_offset", pr.cursor.next)
	pr.w.stats.Update(pr.fn.Name, pr.part.Topic, pr.part.Partition, func(p *observe.PartitionStats) {
		p.NextOffset, p.HighWater = pr.cursor.next, max(lagEnd, pr.cursor.next)
	})
	return nil
}

// fetched is a batch read by prefetch, or why it could not be. afters
// says, for the batch's records followed by offsets without a committed
// record, where the cursor goes once each is applied
// (partitionTracker.afters). With no batch, passed is how far the reader
// went over such offsets. lagEnd is where the partition's lag ends.
type fetched struct {
	batch          []kfn.Record
	afters         map[int64]int64
	passed, lagEnd int64
	err            error
}

// prefetch reads the next batch (fetch) in a goroutine of its own and
// delivers it on the returned channel, which gets exactly one value.
func (pr *partitionRun) prefetch(ctx context.Context, reader *kafkasource.Reader) <-chan fetched {
	out := make(chan fetched, 1)
	go func() { out <- pr.fetch(ctx, reader) }()
	return out
}

// fetch blocks for the first record, then gathers more until the batch is
// full (BatchSize records, or records of BatchMaxBytes: the last one takes
// it there, so a batch holds at most BatchMaxBytes plus one record) or
// BatchWait has passed since the first one. Offsets the reader
// passes without a record (kafkasource.ErrPassedOnly) go to the batch's last record,
// whose commit then moves the cursor past them; before the first record,
// the lane waits BatchWait for one, and returns without a batch, how far
// the reader passed, when none comes.
func (pr *partitionRun) fetch(ctx context.Context, reader *kafkasource.Reader) fetched {
	max := pr.w.cfg.BatchSize
	batch := make([]kfn.Record, 0, max)
	var afters map[int64]int64
	passedAfter := func(rec kfn.Record, after int64) {
		if after > rec.Offset+1 {
			if afters == nil {
				afters = map[int64]int64{}
			}
			afters[rec.Offset] = after
		}
	}
	wctx, stop := pr.retry.waitContext(ctx)
	rec, after, err := reader.NextRecord(wctx)
	if errors.Is(err, kafkasource.ErrPassedOnly) {
		// A record coming right behind the markers takes the cursor
		// past them in its batch's commit.
		pctx, cancel := context.WithTimeout(wctx, pr.w.cfg.BatchWait)
		for errors.Is(err, kafkasource.ErrPassedOnly) {
			rec, after, err = reader.NextRecord(pctx)
		}
		waited := pctx.Err() != nil && wctx.Err() == nil
		cancel()
		if err != nil && waited {
			stop()
			return fetched{passed: reader.Passed(), lagEnd: reader.LastStable()}
		}
	}
	stop()
	if err != nil {
		if ctx.Err() == nil && wokenForRetry(wctx) {
			return fetched{err: errRetryWake}
		}
		return fetched{err: fmt.Errorf("read %s: %w", pr.part, err)}
	}
	batch = append(batch, rec)
	passedAfter(rec, after)
	bytes := recordSize(rec)
	// One deadline for the rest of the batch, not a timer per record.
	fctx, cancel := context.WithDeadline(ctx, time.Now().Add(pr.w.cfg.BatchWait))
	defer cancel()
	// The lane's first batch takes what its partition holds and does not
	// wait for more: a lane that starts (a worker scaled from zero, a new
	// owner) has its backlog in hand at once, and waiting BatchWait for
	// records not yet produced would only delay its first commit. Later
	// batches wait, so that a steady flow commits in batches.
	first := !pr.filled
	pr.filled = true
	for len(batch) < max && bytes < pr.w.cfg.BatchMaxBytes && !(first && reader.CaughtUp()) {
		rec, after, err := reader.NextRecord(fctx)
		if errors.Is(err, kafkasource.ErrPassedOnly) {
			passedAfter(batch[len(batch)-1], reader.Passed())
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return fetched{err: ctx.Err()}
			}
			break // deadline: the batch is as full as it gets
		}
		batch = append(batch, rec)
		bytes += recordSize(rec)
		passedAfter(rec, after)
	}
	lagEnd := reader.LastStable()
	pr.w.stats.Update(pr.fn.Name, pr.part.Topic, pr.part.Partition, func(p *observe.PartitionStats) { p.HighWater = lagEnd })
	return fetched{batch: batch, afters: afters, lagEnd: lagEnd}
}

// uncommitted drops the records below the cursor: after a commit whose
// reply was lost, the reloaded cursor says how far it got.
func uncommitted(batch []kfn.Record, next int64) []kfn.Record {
	for len(batch) > 0 && batch[0].Offset < next {
		batch = batch[1:]
	}
	return batch
}

// kafkaOutage is a lane waiting for Kafka: capped exponential backoff
// (100 ms to 1 s, so that reading resumes within about a second of the
// broker's return). Its failures go to the worker's repeats, so that the
// lanes of a worker waiting for one broker log one line per step of its
// schedule, and one when Kafka answers again.
type kafkaOutage struct {
	log     *slog.Logger
	repeats *repeatlog.Log
	bo      *backoff.ExponentialBackOff
	since   time.Time // zero when Kafka answers
}

// kafkaUnreadable is the kind of a lane's failure to read from Kafka.
const kafkaUnreadable = "cannot read from Kafka: waiting, keeping the partition"

func newKafkaOutage(log *slog.Logger, repeats *repeatlog.Log) *kafkaOutage {
	return &kafkaOutage{log: log, repeats: repeats, bo: backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(100*time.Millisecond),
		backoff.WithMaxInterval(time.Second),
		backoff.WithMaxElapsedTime(0),
	)}
}

// wait sleeps before the next read after err.
func (o *kafkaOutage) wait(ctx context.Context, err error) error {
	if o.since.IsZero() {
		o.since = time.Now()
		o.bo.Reset()
	}
	o.repeats.Failed(ctx, o.log, slog.LevelWarn, kafkaUnreadable, "err", err)
	return sleep(ctx, o.bo.NextBackOff())
}

// over notes that Kafka answered.
func (o *kafkaOutage) over() {
	if !o.since.IsZero() {
		o.repeats.Over(context.Background(), o.log, kafkaUnreadable)
		o.log.Debug("reading from Kafka again", "after", time.Since(o.since).Round(time.Millisecond))
		o.since = time.Time{}
	}
}

// retryInfra retries op on infrastructure errors (Postgres or Kafka
// unreachable) with capped exponential backoff, forever, until ctx ends. A
// fencing error is final and returned at once. The failures are logged
// through repeats, shared by the worker's lanes: once per step of its
// schedule with their count, however many lanes retry, and once when op
// succeeds again after them.
func retryInfra(ctx context.Context, repeats *repeatlog.Log, log *slog.Logger, what string, op func(context.Context) error) error {
	policy := backoff.NewExponentialBackOff()
	policy.InitialInterval = 100 * time.Millisecond
	// A lane resumes within 1.5 s (the cap, randomized by ±50%) of the
	// service's return: under the lease TTL of the fault tests (2 s).
	policy.MaxInterval = time.Second
	policy.MaxElapsedTime = 0
	msg := what + " failed, retrying"
	failed := false
	err := backoff.RetryNotify(func() error {
		err := op(ctx)
		if errors.Is(err, inbox.ErrFenced) || ctx.Err() != nil {
			return backoff.Permanent(err)
		}
		return err
	}, backoff.WithContext(policy, ctx), func(err error, wait time.Duration) {
		if errors.Is(err, inbox.ErrCannotEndOlderOwner) {
			log.Debug(msg, "err", err, "retry_in", wait) // claimBlocked has said it once, and counts it
			return
		}
		failed = true
		repeats.Failed(ctx, log, slog.LevelWarn, msg, "err", err, "retry_in", wait)
	})
	if failed && err == nil {
		repeats.Over(ctx, log, msg)
	}
	return err
}
