package outbox

import (
	"context"
	"sync"
	"time"
)

// readRequest is one shard loop asking for its next batch: the rows its
// last batch relayed (to delete) and its parked keys. rows receives the
// batch.
type readRequest struct {
	shard   int
	parked  []string
	relayed []int64
	rows    []relayRow
	done    chan readResult // buffered: the reader never waits for the asker
}

// readResult answers a readRequest: err, or, when lead is set, no answer
// yet: the asker is to read for everyone waiting.
type readResult struct {
	err  error
	lead bool
}

// batchReader reads the batches of all the shard loops of a relay with one
// query for all the shards asking at the same moment, instead of one query
// per shard: every commit wakes the shards of the keys it wrote, which is
// usually most of them. It has no goroutine of its own: the first asker
// reads for everyone waiting (the leader); askers arriving meanwhile wait,
// and when the leader is done, one of them leads the next read. Each shard
// still asks only when its last batch is settled, which is what
// selectShardBatch's correctness rests on.
type batchReader struct {
	r       *Relay
	mu      sync.Mutex
	pending []*readRequest
	leading bool
	scratch readScratch // the leader's
}

// read returns the shard's next batch, appended to buf.
func (b *batchReader) read(ctx context.Context, shard int, parked []string, relayed []int64, buf []relayRow) ([]relayRow, error) {
	req := &readRequest{shard: shard, parked: parked, relayed: relayed, rows: buf, done: make(chan readResult, 1)}
	b.mu.Lock()
	b.pending = append(b.pending, req)
	lead := !b.leading
	b.leading = true
	b.mu.Unlock()
	for {
		if lead {
			b.lead(ctx)
		}
		select {
		case res := <-req.done:
			if res.lead {
				lead = true
				continue
			}
			return req.rows, res.err
		case <-ctx.Done():
			// The leader answers into the buffered channel anyway; if it
			// hands the lead to this request, the next asker waits for
			// the lead until the leader below hands it on.
			go b.abandon(req)
			return nil, ctx.Err()
		}
	}
}

// lead reads for every pending request, then hands the lead to the first
// request that arrived meanwhile, if any.
func (b *batchReader) lead(ctx context.Context) {
	b.mu.Lock()
	reqs := b.pending
	b.pending = nil
	b.mu.Unlock()
	// The read serves other shards too: it must not fail because this
	// shard is stopping. A statement runs at most the session's
	// statement_timeout; a minute bounds it where none is set.
	readCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	err := readShards(readCtx, b.r.cfg.Pool, reqs, b.r.cfg.BatchSize, &b.scratch)
	cancel()
	for _, req := range reqs {
		if err != nil {
			req.rows = req.rows[:0]
		}
		req.done <- readResult{err: err}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.pending) == 0 {
		b.leading = false
		return
	}
	b.pending[0].done <- readResult{lead: true}
}

// abandon serves a request whose asker has gone (its shard stopped): if it
// is handed the lead, it leads for the others.
func (b *batchReader) abandon(req *readRequest) {
	for res := range req.done {
		if !res.lead {
			return
		}
		b.lead(context.Background())
	}
}
