package engine

import (
	"cmp"
	"context"
	"errors"
	"hash/fnv"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/faults"
	"github.com/kfn-dev/kfn/internal/observe"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// Key-lanes: a partition run with KeyConcurrency K > 1 (see the package
// doc, "Key-lanes"). The partition's reader dispatches each record to the
// key-lane of its key (keyLaneOf), in offset order; each key-lane applies
// its records in offset order through an applier of its own, whose
// transactions are fenced by the key-lane's row (keyLaneTracker); the
// cursor mover moves the cursor, in small fenced transactions of its own,
// over the prefix of dispatched offsets that every key-lane has committed.

// keyLaneOf is the key-lane of a record with key key among lanes
// key-lanes: a 64-bit FNV-1a hash of the key's bytes, mixed (so that it is
// independent of outbox.LaneOf, which splits a subject over lanes by
// FNV-1a 32 first). A record with no key (nil) goes to key-lane 0: the
// records without a key keep their offset order among themselves, as if
// they had one key.
func keyLaneOf(key []byte, lanes int) int {
	if lanes <= 1 || key == nil {
		return 0
	}
	h := fnv.New64a()
	h.Write(key)
	x := h.Sum64()
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	return int(x % uint64(lanes))
}

// pendingOffset is a dispatched record that the cursor has not passed yet.
type pendingOffset struct {
	offset int64
	after  int64 // where the cursor may go once it is committed (partitionTracker.cursorAfter)
	done   bool  // its key-lane committed it (applied, dead-lettered or skipped as handled before)
	size   int   // its record's bytes (recordSize), counted in the window's bytes
}

// keyLaneRun is the key-lanes of one owned partition.
type keyLaneRun struct {
	pr    *partitionRun
	lanes []*keyLane
	// highWater is the cursor's high-water mark at the claim: the key-lanes
	// skip offsets below it (handled before, their inbox rows maybe
	// purged). Records above it are never passed by the cursor before their
	// key-lane commits them, so it need not follow the cursor.
	highWater int64
	window    int // dispatched records not under the cursor, at most
	// windowBytes bounds those records' bytes as --batch-max-bytes bounds a
	// lane's batch: a record is dispatched while fewer are held, so the
	// key-lanes hold at most windowBytes plus one record, what one lane's
	// batch holds (worker_memory.go's laneMemory counts it so).
	windowBytes  int
	pendingBytes int

	mu   sync.Mutex
	cond *sync.Cond // queues, pending, the cursor's target and failures changed
	// pending holds the dispatched records the cursor has not passed, in
	// offset order; target is where the cursor may go: past the longest
	// committed prefix of what was dispatched.
	pending  []*pendingOffset
	target   int64
	frontier int64 // the offset after the last dispatched record
	stopped  bool  // the key-lanes are asked to stop
	failed   error // the first error that stopped a key-lane or the mover
	// paused keeps the mover from the cursor while the partition moves it
	// itself, drained (drain to drained).
	paused    bool
	moverGone bool
	moverUp   chan struct{}
	cancel    context.CancelFunc // ends the key-lanes' context (start)
}

// keyLane is one key-lane: its records in offset order, applied through
// its own applier.
type keyLane struct {
	*applier
	set   *keyLaneRun
	index int
	queue []kfn.Record     // dispatched, not taken yet
	owed  []*pendingOffset // taken or queued, not committed yet, in offset order
}

// newKeyLaneRun makes the k key-lanes of pr once it has claimed its
// partition.
func (pr *partitionRun) newKeyLaneRun(k int) *keyLaneRun {
	r := &keyLaneRun{pr: pr, highWater: pr.cursor.highWater, window: k * pr.w.cfg.BatchSize, windowBytes: pr.w.cfg.BatchMaxBytes,
		target: pr.cursor.next, frontier: pr.cursor.next, moverUp: make(chan struct{}, 1)}
	r.cond = sync.NewCond(&r.mu)
	for i := range k {
		kl := &keyLane{set: r, index: i}
		tracker := &keyLaneTracker{lane: kl}
		kl.applier = pr.w.newApplier(pr.fn, pr.part, pr.token, tracker, pr.log.With("key_lane", i, "key_lanes", k))
		kl.generation = pr.generation
		if pr.held != nil {
			kl.held = newHeldKeys(nil)
			kl.held.load(pr.held.list())
		}
		r.lanes = append(r.lanes, kl)
	}
	return r
}

// start runs the key-lanes and the cursor mover until ctx ends or one of
// them fails. It returns the context the partition's reader runs under
// (ended by either) and wait, which waits for the key-lanes, lets the
// mover move the cursor over what they committed, and returns the failure.
func (r *keyLaneRun) start(ctx context.Context) (context.Context, func() error) {
	ctx, cancel := context.WithCancel(ctx)
	r.cancel = cancel
	var wg sync.WaitGroup
	for _, kl := range r.lanes {
		wg.Go(func() { r.fail(kl.run(ctx)) })
	}
	// The mover outlives the key-lanes' context, for its last move.
	moverCtx, stopMover := context.WithCancel(context.WithoutCancel(ctx))
	moverDone := make(chan struct{})
	go func() {
		defer close(moverDone)
		err := r.moveCursor(moverCtx, ctx)
		r.mu.Lock()
		r.moverGone = true
		r.mu.Unlock()
		r.fail(err)
		r.cond.Broadcast()
	}()
	stopping := context.AfterFunc(ctx, r.stop)
	return ctx, func() error {
		stopping()
		r.stop()
		wg.Wait()
		r.wakeMover()
		r.mu.Lock()
		r.paused = false
		for r.failed == nil && !r.moverGone && r.pr.cursor.next < r.target {
			r.cond.Wait()
		}
		r.mu.Unlock()
		stopMover()
		<-moverDone
		cancel()
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.failed
	}
}

// stop asks the key-lanes to stop after their transaction in flight.
func (r *keyLaneRun) stop() {
	r.mu.Lock()
	r.stopped = true
	r.mu.Unlock()
	r.cond.Broadcast()
}

// fail records the first error that stopped a key-lane or the mover (nil
// and a cancelled context are no failure) and stops the others.
func (r *keyLaneRun) fail(err error) {
	if err == nil || errors.Is(err, context.Canceled) {
		return
	}
	r.mu.Lock()
	if r.failed == nil {
		r.failed = err
	}
	r.stopped = true
	r.mu.Unlock()
	r.cond.Broadcast()
	r.cancel()
}

// dispatch hands batch, read in offset order after the frontier, to the
// key-lanes of its records' keys. It waits while the window of records not
// under the cursor is full. afters is fetched.afters.
func (r *keyLaneRun) dispatch(ctx context.Context, batch []kfn.Record, afters map[int64]int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rec := range batch {
		if rec.Offset < r.frontier {
			continue // read again after a new reader
		}
		for (len(r.pending) >= r.window || r.pendingBytes >= r.windowBytes) && !r.stopped {
			r.cond.Wait()
		}
		if r.stopped {
			return cmp.Or(r.failed, ctx.Err(), context.Canceled)
		}
		p := &pendingOffset{offset: rec.Offset, after: max(rec.Offset+1, afters[rec.Offset]), size: recordSize(rec)}
		r.pending = append(r.pending, p)
		r.pendingBytes += p.size
		r.frontier = p.after
		kl := r.lanes[keyLaneOf(rec.Key, len(r.lanes))]
		kl.queue = append(kl.queue, rec)
		kl.owed = append(kl.owed, p)
	}
	r.cond.Broadcast()
	return nil
}

// drain waits until every dispatched record is committed and the cursor
// has moved past them all, and then keeps the mover away from the cursor
// until drained: the partition is then as a one-lane partition between two
// batches, and may move its cursor by itself (a pass over offsets without
// records, a new reader, dead letter retries, a batch with expired
// records).
func (r *keyLaneRun) drain(ctx context.Context) error {
	if r == nil {
		return nil
	}
	r.wakeMover()
	r.mu.Lock()
	defer r.mu.Unlock()
	for (len(r.pending) > 0 || r.pr.cursor.next < r.target) && !r.stopped {
		r.cond.Wait()
	}
	if r.stopped {
		return cmp.Or(r.failed, ctx.Err(), context.Canceled)
	}
	r.paused = true
	return nil
}

// drained ends drain: the key-lanes and the mover go on from where the
// partition left the cursor.
func (r *keyLaneRun) drained() {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.paused = false
	r.target = max(r.target, r.pr.cursor.next)
	r.frontier = max(r.frontier, r.pr.cursor.next)
}

// cursor returns pr's cursor (the next offset), for the reader.
func (r *keyLaneRun) cursor(pr *partitionRun) int64 {
	if r == nil {
		return pr.cursor.next
	}
	return r.next()
}

// next returns the cursor.
func (r *keyLaneRun) next() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pr.cursor.next
}

// frontierAt returns the offset after the last dispatched record.
func (r *keyLaneRun) frontierAt() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.frontier
}

// committed marks the records of kl up to last as committed and moves the
// cursor's target over the committed prefix.
func (r *keyLaneRun) committed(kl *keyLane, last int64) {
	r.mu.Lock()
	for len(kl.owed) > 0 && kl.owed[0].offset <= last {
		kl.owed[0].done = true
		kl.owed = kl.owed[1:]
	}
	moved := false
	for len(r.pending) > 0 && r.pending[0].done {
		r.target = r.pending[0].after
		r.pendingBytes -= r.pending[0].size
		r.pending = r.pending[1:]
		moved = true
	}
	r.mu.Unlock()
	if moved {
		r.cond.Broadcast()
		r.wakeMover()
	}
}

func (r *keyLaneRun) wakeMover() {
	select {
	case r.moverUp <- struct{}{}:
	default:
	}
}

// moveCursor moves the cursor to the target whenever the target moves, in
// a fenced transaction of its own (inbox.Advance, which moves no inbox
// row), until ctx ends. lanes is the key-lanes' context: once it has ended,
// a move that fails is not retried (the next owner resumes lower, and the
// inbox skips what the key-lanes committed above).
func (r *keyLaneRun) moveCursor(ctx, lanes context.Context) error {
	pr := r.pr
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-r.moverUp:
		}
		// The key-lanes' commits that come meanwhile go in the same move.
		if lanes.Err() == nil && sleep(lanes, moveCoalesce) != nil {
			r.wakeMover() // stopping: the last move, at once
			continue
		}
		r.mu.Lock()
		from, to := pr.cursor.next, r.target
		skip := r.paused || to <= from
		r.mu.Unlock()
		if skip {
			r.cond.Broadcast()
			continue
		}
		err := retryInfra(ctx, pr.repeats, pr.log, "move the cursor over the key-lanes' commits", func(ctx context.Context) error {
			err := pr.w.withTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
				faults.Lane(faults.BeforeFence, pr.part, pr.token)
				return inbox.Advance(ctx, tx, pr.part, pr.token, from, to)
			})
			var moved *inbox.CursorMovedError
			switch {
			case err == nil:
				faults.Lane(faults.AfterFence, pr.part, pr.token)
			case errors.Is(err, inbox.ErrFenced):
				faults.Lane(faults.FenceRefused, pr.part, pr.token)
			case errors.As(err, &moved) && moved.Cursor.NextOffset >= to:
				// An earlier move of ours landed without its reply.
				pr.w.stats.CommitRepliesLost.Add(1)
				pr.w.stats.CountFn(pr.fn.Name, func(c *observe.FunctionCounters) { c.CommitRepliesLost++ })
				return nil
			case errors.As(err, &moved):
				return backoff.Permanent(err) // a move of ours to below `to` landed: move on from there
			case lanes.Err() != nil:
				return backoff.Permanent(errStoppedUnmoved)
			}
			return err
		})
		var moved *inbox.CursorMovedError
		switch {
		case errors.Is(err, errStoppedUnmoved):
			return nil
		case errors.As(err, &moved):
			r.mu.Lock()
			pr.cursor.next, pr.cursor.highWater = max(pr.cursor.next, moved.Cursor.NextOffset), max(pr.cursor.highWater, moved.Cursor.HighWater)
			r.mu.Unlock()
			r.wakeMover()
			continue
		case err != nil:
			return err
		}
		r.mu.Lock()
		if to > pr.cursor.next {
			pr.cursor.passed(to)
		}
		r.mu.Unlock()
		r.cond.Broadcast()
		pr.w.stats.Update(pr.fn.Name, pr.part.Topic, pr.part.Partition, func(p *observe.PartitionStats) {
			p.NextOffset = to
			p.LastCommit = time.Now()
		})
	}
}

// moveCoalesce is how long the cursor mover waits after a key-lane's
// commit before it moves the cursor, so that one move covers the commits
// of several key-lanes.
const moveCoalesce = 5 * time.Millisecond

// errStoppedUnmoved: the key-lanes stopped and the cursor's last move
// failed; it is not retried.
var errStoppedUnmoved = errors.New("the key-lanes stopped before the cursor moved over their last commits")

// run applies the key-lane's records until it is stopped, its transaction
// in flight done.
func (kl *keyLane) run(ctx context.Context) error {
	for {
		recs := kl.take()
		if recs == nil {
			return nil
		}
		err := retryInfra(ctx, kl.repeats, kl.log, "apply batch", func(ctx context.Context) error {
			done, err := kl.apply(ctx, recs)
			recs = recs[done:]
			return err
		})
		if err != nil {
			return err
		}
	}
}

// take waits for records and returns up to a batch of them, or nil once
// the key-lanes are stopped.
func (kl *keyLane) take() []kfn.Record {
	r := kl.set
	r.mu.Lock()
	defer r.mu.Unlock()
	for len(kl.queue) == 0 && !r.stopped {
		r.cond.Wait()
	}
	if r.stopped {
		return nil
	}
	n := min(len(kl.queue), r.pr.w.cfg.BatchSize)
	recs := kl.queue[:n:n]
	kl.queue = kl.queue[n:]
	return recs
}

// dispatch hands a fetched batch to the key-lanes. A batch with a gap after
// the frontier may have lost records to Kafka's retention (see skipGap):
// only a frontier below the partition's first offset is an expiry, and
// then the partition drains its key-lanes and applies the batch as one lane
// does, skipping what expired.
func (pr *partitionRun) dispatch(ctx context.Context, keys *keyLaneRun, f fetched) error {
	frontier := keys.frontierAt()
	batch := uncommitted(f.batch, frontier)
	if len(batch) == 0 {
		return nil
	}
	after := func(r kfn.Record) int64 { return max(r.Offset+1, f.afters[r.Offset]) }
	if gapped(batch, frontier, after) {
		var first int64
		err := retryInfra(ctx, pr.repeats, pr.log, "check for expired records", func(ctx context.Context) error {
			var err error
			first, _, err = pr.w.kafka.OffsetRange(ctx, pr.part.Topic, pr.part.Partition)
			return err
		})
		if err != nil {
			return err
		}
		if frontier < first {
			if err := keys.drain(ctx); err != nil {
				return err
			}
			defer keys.drained()
			if err := pr.reloadHeld(ctx); err != nil {
				return err
			}
			if err := pr.applyBatch(ctx, batch, f.afters); err != nil {
				return err
			}
			return keys.reloadHeld(ctx)
		}
	}
	return keys.dispatch(ctx, batch, f.afters)
}

// applyRetries applies the dead letters marked for retry on the
// partition, between two batches; with key-lanes, once they are drained.
func (pr *partitionRun) applyRetries(ctx context.Context, keys *keyLaneRun) error {
	if keys == nil || pr.retry == nil || !pr.retry.pending.Load() {
		return pr.retry.applyPending(ctx)
	}
	if err := keys.drain(ctx); err != nil {
		return err
	}
	defer keys.drained()
	if err := pr.retry.applyPending(ctx); err != nil {
		return err
	}
	return keys.reloadHeld(ctx)
}

// reloadHeld reads the partition's parked keys again into the key-lanes'
// views (KeyOrder ParkKey), after the partition applied records or dead
// letters by itself.
func (r *keyLaneRun) reloadHeld(ctx context.Context) error {
	if r.pr.held == nil {
		return nil
	}
	list, err := inbox.HeldKeys(ctx, r.pr.pool, r.pr.part)
	if err != nil {
		return err
	}
	for _, kl := range r.lanes {
		kl.held.load(list)
	}
	return nil
}
