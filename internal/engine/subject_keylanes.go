package engine

import (
	"context"
	"errors"
	"sync"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// Key-lanes of a NATS-triggered function's lane (KeyConcurrency K > 1). A
// subject lane acks its events in batches (AckAll, up to a batch's last
// event) and its cursor is a progress marker below which no event of the
// lane is unhandled, so its key-lanes work batch by batch: the batch's
// events are split by key (keyLaneOf) over the key-lanes, which apply
// theirs side by side, each in transactions fenced by its key-lane's row;
// once all have committed, the lane moves its cursor past the batch in a
// small fenced transaction, and acks it.

// applyBatch applies recs, the lane's events of one fetched batch, in
// stream order per key.
func (sr *subjectRun) applyBatch(ctx context.Context, recs []kfn.Record) error {
	k := sr.w.keyConcurrency(sr.fn)
	if k <= 1 {
		return retryInfra(ctx, sr.repeats, sr.log, "apply batch", func(ctx context.Context) error {
			done, err := sr.apply(ctx, recs)
			recs = recs[done:]
			return err
		})
	}
	if sr.keyLanes == nil {
		for i := range k {
			a := sr.w.newApplier(sr.fn, sr.part, sr.token,
				&subjectTracker{consumer: sr.fn.Name, part: sr.part, token: sr.token, keyLanes: true, keyLane: i},
				sr.log.With("key_lane", i, "key_lanes", k))
			a.generation = sr.generation
			sr.keyLanes = append(sr.keyLanes, a)
		}
	}
	split := make([][]kfn.Record, k)
	last := recs[0].Offset
	for _, r := range recs {
		i := keyLaneOf(r.Key, k)
		split[i] = append(split[i], r)
		last = max(last, r.Offset)
	}
	lanesCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, k)
	for i, part := range split {
		if len(part) == 0 {
			continue
		}
		wg.Go(func() {
			errs[i] = retryInfra(lanesCtx, sr.repeats, sr.keyLanes[i].log, "apply batch", func(ctx context.Context) error {
				done, err := sr.keyLanes[i].apply(ctx, part)
				part = part[done:]
				return err
			})
			if errs[i] != nil {
				cancel() // fenced, or stopping: the others stop after their transaction in flight
			}
		})
	}
	wg.Wait()
	if err := firstKeyLaneError(errs); err != nil {
		return err
	}
	// Every key-lane committed its events: the lane's cursor moves past
	// the batch.
	return retryInfra(ctx, sr.repeats, sr.log, "move the lane's cursor past the batch", func(ctx context.Context) error {
		return sr.w.withTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
			return inbox.Fence(ctx, tx, sr.part, sr.token, last)
		})
	})
}

// firstKeyLaneError returns a fencing error if a key-lane was fenced, else
// the first error.
func firstKeyLaneError(errs []error) error {
	var first error
	for _, err := range errs {
		if err == nil {
			continue
		}
		if errors.Is(err, inbox.ErrFenced) {
			return err
		}
		if first == nil {
			first = err
		}
	}
	return first
}
