package bench

import (
	"cmp"
	"slices"
	"sync"
	"time"
)

// This file holds a mode's commit latency: for each record, the time from
// its transaction's BEGIN (its batch fetched and in the lane's hands) to
// the COMMIT's reply. Every record of a batch has its batch's latency, so
// the percentiles are over records, not transactions: a mode that commits
// few large batches is not flattered by them.

// commitTimes collects the transactions of one round.
type commitTimes struct {
	mu  sync.Mutex
	txs []commitTime
}

type commitTime struct {
	took    time.Duration
	records int
}

// add records a committed transaction of records records.
func (c *commitTimes) add(records int, took time.Duration) {
	c.mu.Lock()
	c.txs = append(c.txs, commitTime{took: took, records: records})
	c.mu.Unlock()
}

// timed runs commit, one transaction of records records, and adds its
// duration when it succeeds.
func (c *commitTimes) timed(records int, commit func() error) error {
	start := time.Now()
	if err := commit(); err != nil {
		return err
	}
	c.add(records, time.Since(start))
	return nil
}

// Latency is a round's commit latency over its records.
type Latency struct {
	P50, P99     time.Duration
	Transactions int
}

// latency is the p50 and p99 over the records of the collected
// transactions (zero without any).
func (c *commitTimes) latency() Latency {
	c.mu.Lock()
	txs := slices.Clone(c.txs)
	c.mu.Unlock()
	slices.SortFunc(txs, func(a, b commitTime) int { return cmp.Compare(a.took, b.took) })
	var total int
	for _, t := range txs {
		total += t.records
	}
	at := func(q float64) time.Duration {
		rank := int(q * float64(total)) // the record at this rank, counted from 0
		for _, t := range txs {
			if rank < t.records {
				return t.took
			}
			rank -= t.records
		}
		return 0
	}
	if total == 0 {
		return Latency{Transactions: len(txs)}
	}
	return Latency{P50: at(0.50), P99: at(0.99), Transactions: len(txs)}
}
