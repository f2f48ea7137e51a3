package runtime

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/outbox"
)

// BenchConfig describes one benchmark run: Records records already in
// Topic, applied by fn in each mode.
type BenchConfig struct {
	Worker       Config   // connections and batching; shared by every mode
	Function     Function // the handler under test; its Topic holds the data
	Records      int64    // records in the topic, all applied by the batched modes
	NaiveRecords int64    // how many of them the naive mode applies (it is slow)
	// Reset clears the function's business tables between modes, so every
	// mode does the same writes.
	Reset func(ctx context.Context, tx pgx.Tx) error
	// Rounds runs the modes this many times, interleaved, and reports each
	// mode's median round, so a noisy neighbour skews no mode alone.
	// Default 1.
	Rounds int
}

// BenchResult is the throughput of one mode: its median round.
type BenchResult struct {
	Mode      string
	Records   int64
	Elapsed   time.Duration
	PerSecond float64
	Rounds    []float64 // msgs/s of every round, in order
}

// Bench runs three modes over the same records, one after the other, and
// returns their throughput:
//   - exactly-once: the kfn record path (batched transaction with the fenced
//     cursor and the inbox claim);
//   - at-least-once: the same batching and handler, without inbox or fence;
//   - naive: a Kafka consumer group, one transaction and one synchronous
//     offset commit per record.
func Bench(ctx context.Context, cfg BenchConfig) ([]BenchResult, error) {
	if cfg.Function.Handler == nil {
		return nil, errors.New("bench: the naive mode needs a Function with a Handler")
	}
	if cfg.NaiveRecords > cfg.Records || cfg.NaiveRecords < 1 {
		return nil, fmt.Errorf("bench: naive records %d must be in 1..%d", cfg.NaiveRecords, cfg.Records)
	}
	// The record path alone is measured: the outbox rows stay in the table.
	cfg.Worker.NoRelay = true
	modes := []struct {
		name string
		run  func(context.Context, BenchConfig, string) (int64, time.Duration, error)
	}{
		{"exactly-once", benchBatched(nil)},
		{"at-least-once", benchBatched(atLeastOnce)},
		{"naive", benchNaive},
	}
	rounds := make([][]BenchResult, len(modes))
	for round := 0; round < max(1, cfg.Rounds); round++ {
		for i, mode := range modes {
			consumer := fmt.Sprintf("%s-%s-%d", cfg.Function.Name, mode.name, time.Now().UnixNano())
			n, elapsed, err := mode.run(ctx, cfg, consumer)
			if err != nil {
				return nil, fmt.Errorf("bench %s: %w", mode.name, err)
			}
			rounds[i] = append(rounds[i], BenchResult{Mode: mode.name, Records: n, Elapsed: elapsed, PerSecond: float64(n) / elapsed.Seconds()})
			if err := benchReset(ctx, cfg); err != nil {
				return nil, err
			}
		}
	}
	results := make([]BenchResult, len(modes))
	for i, rs := range rounds {
		rates := make([]float64, len(rs))
		for j, r := range rs {
			rates[j] = r.PerSecond
		}
		sort.Slice(rs, func(a, b int) bool { return rs[a].PerSecond < rs[b].PerSecond })
		results[i] = rs[len(rs)/2]
		results[i].Rounds = rates
	}
	return results, nil
}

func benchReset(ctx context.Context, cfg BenchConfig) error {
	w, err := NewWorker(ctx, cfg.Worker, cfg.Function)
	if err != nil {
		return err
	}
	defer w.w.close()
	return w.w.withTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `TRUNCATE kfn.outbox, kfn.inbox`); err != nil {
			return fmt.Errorf("reset between benchmark modes: %w", err)
		}
		if cfg.Reset == nil {
			return nil
		}
		return cfg.Reset(ctx, tx)
	})
}

// atLeastOnce is the benchmark's baseline ledger: the same batching and
// transactions, but no inbox claim and no fenced cursor move, so the
// difference to exactly-once is what those cost. The cursor only moves in
// memory (and to Kafka's group offsets).
func atLeastOnce(cursor *partitionLedger) ledger { return atLeastOnceLedger{cursor} }

type atLeastOnceLedger struct{ cursor *partitionLedger }

func (l atLeastOnceLedger) claim(_ context.Context, _ pgx.Tx, recs []Record) ([]Record, error) {
	return recs, nil
}
func (atLeastOnceLedger) fence(context.Context, pgx.Tx, Record) error            { return nil }
func (atLeastOnceLedger) markDeadLettered(context.Context, pgx.Tx, Record) error { return nil }
func (l atLeastOnceLedger) committed(last Record)                                { l.cursor.committed(last) }

// benchBatched runs a worker with the given partition ledger (nil: the
// exactly-once one) until it has applied every record. The clock starts at the first commit, so start-up (leases,
// connections) is not counted; nor is it for the naive mode.
func benchBatched(partitionLedger func(*partitionLedger) ledger) func(context.Context, BenchConfig, string) (int64, time.Duration, error) {
	return func(ctx context.Context, cfg BenchConfig, consumer string) (int64, time.Duration, error) {
		fn := cfg.Function
		fn.Name = consumer
		wk, err := NewWorker(ctx, cfg.Worker, fn)
		if err != nil {
			return 0, 0, err
		}
		wk.w.partitionLedger = partitionLedger
		runCtx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- wk.Run(runCtx) }()
		defer func() {
			stop()
			<-done
		}()
		var start time.Time
		var before int64
		for applied := int64(0); applied < cfg.Records; applied = wk.Stats().Applied.Load() {
			if start.IsZero() && applied > 0 {
				start, before = time.Now(), applied
			}
			if err := sleep(ctx, time.Millisecond); err != nil {
				return 0, 0, err
			}
		}
		return wk.Stats().Applied.Load() - before, time.Since(start), nil
	}
}

// benchNaive is the baseline most consumers start with: a consumer group
// reader, and per record one transaction and one synchronous offset commit.
func benchNaive(ctx context.Context, cfg BenchConfig, consumer string) (int64, time.Duration, error) {
	wk, err := NewWorker(ctx, cfg.Worker, cfg.Function)
	if err != nil {
		return 0, 0, err
	}
	w := wk.w
	defer w.close()
	reader := kafka.NewReader(kafka.ReaderConfig{
		Brokers: w.cfg.KafkaBrokers, GroupID: consumer, Topic: cfg.Function.Topic,
		StartOffset: kafka.FirstOffset, MinBytes: 1, MaxBytes: 16 << 20, MaxWait: 100 * time.Millisecond,
		Logger: kafka.LoggerFunc(func(string, ...any) {}),
	})
	defer reader.Close()
	var n int64
	var start time.Time
	for n < cfg.NaiveRecords {
		msg, err := reader.FetchMessage(ctx)
		if err != nil {
			return 0, 0, err
		}
		rec := toRecord(msg)
		rec.Attempt = 1
		emitter := newEmitCollector(cfg.Function, 0)
		err = w.withTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
			if err := cfg.Function.Handler(ctx, tx, rec, &Events{emit: emitter.emit, rec: rec}); err != nil {
				return err
			}
			if emitter.err != nil {
				return emitter.err
			}
			return outbox.Insert(ctx, tx, emitter.rows)
		})
		if err != nil {
			return 0, 0, err
		}
		if err := reader.CommitMessages(ctx, msg); err != nil {
			return 0, 0, err
		}
		if start.IsZero() {
			start = time.Now() // the group has joined and one record is through
			continue
		}
		n++
	}
	return n, time.Since(start), nil
}
