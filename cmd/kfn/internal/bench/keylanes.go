package bench

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/runtime"
)

// keyLanesBatch is the batch size of the key-lanes benchmark's runs.
const keyLanesBatch = 10

// KeyLanesConfig is the key-lanes benchmark: a slow handler on one
// partition, run as one lane and as Lanes key-lanes (KeyConcurrency).
type KeyLanesConfig struct {
	Worker  runtime.Config // connections and batching
	Topic   string         // one partition holding Records records, of many keys
	Records int64
	Lanes   int           // the key-lanes of the second run
	Wait    time.Duration // what the handler waits per record, inside its transaction (pg_sleep)
	// Rounds runs both this many times, interleaved, and reports each
	// one's median round, so a noisy neighbour skews neither alone.
	// Default 1.
	Rounds int
	// Processes are those whose CPU time is counted (FindProcesses).
	Processes []Process
}

// KeyLanesResult is the two runs, one lane (One) and Lanes key-lanes
// (Many), and the ratio of their rates.
type KeyLanesResult struct {
	Lanes     int
	Wait      time.Duration
	One, Many Result
}

// Ratio is how many times faster the key-lanes applied the records.
func (r KeyLanesResult) Ratio() float64 { return r.Many.PerSecond / r.One.PerSecond }

func (r KeyLanesResult) String() string {
	line := func(res Result, k int) string {
		rounds := make([]string, len(res.Rounds))
		for i, r := range res.Rounds {
			rounds[i] = fmt.Sprintf("%.0f", r)
		}
		return fmt.Sprintf("  KeyConcurrency %-3d %6d records  %6.2f s  %8.0f msgs/s  %.2f CPU-s/10k  (rounds: %s msgs/s)\n",
			k, res.Records, res.Elapsed.Seconds(), res.PerSecond, res.CPUPer10k(""), strings.Join(rounds, ", "))
	}
	return fmt.Sprintf("key-lanes: one partition, a handler that waits %s per record inside its transaction (pg_sleep), batches of %d records\n", r.Wait, keyLanesBatch) +
		line(r.One, 1) + line(r.Many, r.Lanes) +
		fmt.Sprintf("  %d key-lanes / 1: %.1f× the rate (medians of %d interleaved rounds)\n", r.Lanes, r.Ratio(), len(r.One.Rounds))
}

// KeyLanes applies the records of cfg.Topic with a handler that waits
// cfg.Wait per record inside its transaction, once as one lane and once as
// cfg.Lanes key-lanes, each under a consumer of its own, and times each
// from its first commit to its last.
func KeyLanes(ctx context.Context, cfg KeyLanesConfig) (KeyLanesResult, error) {
	res := KeyLanesResult{Lanes: cfg.Lanes, Wait: cfg.Wait}
	var ones, manys []Result
	for range max(1, cfg.Rounds) {
		one, err := keyLanesRun(ctx, cfg, 1)
		if err != nil {
			return res, err
		}
		many, err := keyLanesRun(ctx, cfg, cfg.Lanes)
		if err != nil {
			return res, err
		}
		ones, manys = append(ones, one), append(manys, many)
	}
	res.One, res.Many = medianRound(ones), medianRound(manys)
	return res, nil
}

// medianRound is the round of median rate, with every round's rate.
func medianRound(rs []Result) Result {
	rates := make([]float64, len(rs))
	for i, r := range rs {
		rates[i] = r.PerSecond
	}
	sorted := slices.Clone(rs)
	slices.SortFunc(sorted, func(a, b Result) int { return cmp.Compare(a.PerSecond, b.PerSecond) })
	m := sorted[len(sorted)/2]
	m.Rounds = rates
	return m
}

func keyLanesRun(ctx context.Context, cfg KeyLanesConfig, lanes int) (Result, error) {
	fn := runtime.Function{
		Name:           fmt.Sprintf("bench-keylanes-%d-%d", lanes, time.Now().UnixNano()),
		Topic:          cfg.Topic,
		KeyConcurrency: lanes,
		Handler: func(ctx context.Context, tx pgx.Tx, _ runtime.Record, _ *runtime.Events) error {
			_, err := tx.Exec(ctx, `SELECT pg_sleep($1)`, cfg.Wait.Seconds())
			return err
		},
	}
	wcfg := cfg.Worker
	wcfg.NoRelay = true
	// A run is timed from its first commit: small batches commit soon, so
	// the time counts nearly every record (with 500 records a batch, one
	// key-lane's first batch could hold all of its records).
	wcfg.BatchSize = keyLanesBatch
	wk, err := engine.NewWorker(ctx, wcfg, fn)
	if err != nil {
		return Result{}, fmt.Errorf("key-lanes %d: %w", lanes, err)
	}
	run := &Config{Processes: cfg.Processes, done: new(atomic.Int64)}
	r, err := runUntil(ctx, run, wk, func() (int64, bool) {
		n := wk.Stats().Applied.Load()
		return n, n >= cfg.Records
	})
	if err != nil {
		return Result{}, fmt.Errorf("key-lanes %d: %w", lanes, err)
	}
	return Result{Mode: fmt.Sprintf("key-lanes %d", lanes), Records: r.records, Elapsed: r.elapsed,
		PerSecond: float64(r.records) / r.elapsed.Seconds(), CPU: r.cpu, Commit: r.commit}, nil
}
