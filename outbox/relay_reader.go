package outbox

import (
	"context"
	"runtime/pprof"
	"slices"
	"sync"
)

// The shard loops read the outbox through one reader per relay, which
// serves the reads asked for at the same time with one query
// (selectShardsBatch): at a steady rate every commit writes to most shards
// and wakes them together, so one query per commit replaces one per shard
// with rows. A loop still reads only once its previous batch is settled,
// and publishes its shard's rows on its own, so a slow key holds back only
// its own shard. Up to readers queries run at once, so that a loop whose
// batch settled while a query runs does not wait for it.

// readers is how many queries the reader runs at once.
const readers = 4

// readRequest is a shard loop's read: delete its relayed rows, then return
// the oldest rows of its shard, without those of its parked keys.
type readRequest struct {
	shard   int32
	parked  []string
	relayed []int64
	out     []relayRow     // the rows go here, appended to out[:0]
	reply   chan readReply // buffered: the reader never waits for a loop
}

type readReply struct {
	rows []relayRow
	full bool // BatchSize rows came: more may be waiting
	err  error
}

// readerRun is a running reader.
type readerRun struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// startReading makes sure the reader runs while a shard loop does: the
// first loop starts it, and it outlives that loop if others run.
func (r *Relay) startReading(ctx context.Context) {
	r.readerMu.Lock()
	defer r.readerMu.Unlock()
	if r.shards++; r.reader != nil {
		return
	}
	readerCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	run := &readerRun{cancel: cancel, done: make(chan struct{})}
	r.reader = run
	var wg sync.WaitGroup
	for range readers {
		wg.Go(func() { pprof.Do(readerCtx, profileLabels, r.serveReads) })
	}
	go func() {
		wg.Wait()
		close(run.done)
	}()
}

// stopReading stops the reader after the last shard loop and waits for it.
func (r *Relay) stopReading() {
	r.readerMu.Lock()
	var stop *readerRun
	if r.shards--; r.shards == 0 {
		stop, r.reader = r.reader, nil
	}
	r.readerMu.Unlock()
	if stop != nil {
		stop.cancel()
		<-stop.done
	}
}

// read asks the reader for the loop's next batch (see readRequest), after
// deleting relayed. It gives up when ctx ends; the reader's answer then
// goes unread.
func (l *shardLoop) read(ctx context.Context, relayed []int64) ([]relayRow, bool, error) {
	req := readRequest{shard: int32(l.shard), parked: l.parkedKeys(), relayed: relayed, out: l.batch.rows, reply: l.reply}
	select {
	case l.r.reads <- req:
	case <-ctx.Done():
		return nil, false, ctx.Err()
	}
	select {
	case rep := <-l.reply:
		return rep.rows, rep.full, rep.err
	case <-ctx.Done(): // the loop stops; the answer, if it comes, is dropped with it
		return nil, false, ctx.Err()
	}
}

// serveReads answers the shard loops' reads until ctx ends: it takes a
// read, then every other read waiting by then, and answers them all with
// one query.
func (r *Relay) serveReads(ctx context.Context) {
	var (
		reqs    []readRequest
		shards  []int32
		parked  []string
		relayed []int64
		rows    []relayRow
		scratch readScratch
	)
	for {
		select {
		case req := <-r.reads:
			reqs = append(reqs[:0], req)
		case <-ctx.Done():
			return
		}
	more:
		for {
			select {
			case req := <-r.reads:
				reqs = append(reqs, req)
			default:
				break more
			}
		}
		shards, parked, relayed = shards[:0], parked[:0], relayed[:0]
		for _, req := range reqs {
			// A key belongs to one shard, so the parked keys of all the
			// shards read exclude no row of another shard. A shard asked
			// twice (a stopped loop's read still queued as its successor
			// asks) is read once.
			if !slices.Contains(shards, req.shard) {
				shards = append(shards, req.shard)
			}
			parked = append(parked, req.parked...)
			relayed = append(relayed, req.relayed...)
		}
		var err error
		r.counters.reads.Add(1)
		rows, err = readBatch(ctx, r.cfg.Pool, shards, parked, r.cfg.BatchSize, relayed, rows[:0], &scratch)
		for _, req := range reqs {
			if err != nil {
				req.reply <- readReply{err: err}
				continue
			}
			out := req.out[:0]
			for i := range rows {
				if rows[i].Shard == req.shard {
					out = append(out, rows[i])
				}
			}
			req.reply <- readReply{rows: out, full: len(out) >= r.cfg.BatchSize}
		}
		clear(rows) // the loops have their copies; drop the references
		reqs = slices.Delete(reqs, 0, len(reqs))
	}
}
