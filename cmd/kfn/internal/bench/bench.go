// Package bench measures what exactly-once costs: it applies the same
// records with the kfn record path, with an at-least-once baseline (the same
// batching without the inbox claim and the fenced cursor) and with the
// naive consumer most projects start with, and reports their throughput
// (kfn bench).
package bench

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

// Config describes one benchmark run: Records records already in
// Topic, applied by fn in each mode.
type Config struct {
	Worker       runtime.Config   // connections and batching; shared by every mode
	Function     runtime.Function // the handler under test; its Topic holds the data
	Records      int64            // records in the topic, all applied by the batched modes
	NaiveRecords int64            // how many of them the naive mode applies (it is slow)
	// Reset clears the function's business tables between modes, so every
	// mode does the same writes.
	Reset func(ctx context.Context, tx pgx.Tx) error
	// Rounds runs the modes this many times, interleaved, and reports each
	// mode's median round, so a noisy neighbour skews no mode alone.
	// Default 1.
	Rounds int
}

// Result is the throughput of one mode: its median round.
type Result struct {
	Mode      string
	Records   int64
	Elapsed   time.Duration
	PerSecond float64
	Rounds    []float64 // msgs/s of every round, in order
}

// Run runs three modes over the same records, one after the other, and
// returns their throughput:
//   - exactly-once: the kfn record path (batched transaction with the fenced
//     cursor and the inbox claim);
//   - at-least-once: the same batching and handler, without inbox or fence;
//   - naive: a Kafka consumer group, one transaction and one synchronous
//     offset commit per record.
func Run(ctx context.Context, cfg Config) ([]Result, error) {
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
		run  func(context.Context, Config, string) (int64, time.Duration, error)
	}{
		{"exactly-once", benchBatched(runtime.NewWorker)},
		{"at-least-once", benchBatched(engine.NewAtLeastOnceWorker)},
		{"naive", benchNaive},
	}
	rounds := make([][]Result, len(modes))
	for round := 0; round < max(1, cfg.Rounds); round++ {
		for i, mode := range modes {
			consumer := fmt.Sprintf("%s-%s-%d", cfg.Function.Name, mode.name, time.Now().UnixNano())
			n, elapsed, err := mode.run(ctx, cfg, consumer)
			if err != nil {
				return nil, fmt.Errorf("bench %s: %w", mode.name, err)
			}
			rounds[i] = append(rounds[i], Result{Mode: mode.name, Records: n, Elapsed: elapsed, PerSecond: float64(n) / elapsed.Seconds()})
			if err := benchReset(ctx, cfg); err != nil {
				return nil, err
			}
		}
	}
	results := make([]Result, len(modes))
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

func benchReset(ctx context.Context, cfg Config) error {
	pool, err := pgxpool.New(ctx, cfg.Worker.DatabaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `TRUNCATE kfn.outbox, kfn.inbox`); err != nil {
			return fmt.Errorf("reset between benchmark modes: %w", err)
		}
		if cfg.Reset == nil {
			return nil
		}
		return cfg.Reset(ctx, tx)
	})
}

// benchBatched runs a worker made by newWorker until it has applied every
// record. The clock starts at the first commit, so start-up (leases,
// connections) is not counted; nor is it for the naive mode.
func benchBatched(newWorker func(context.Context, runtime.Config, ...runtime.Function) (*runtime.Worker, error)) func(context.Context, Config, string) (int64, time.Duration, error) {
	return func(ctx context.Context, cfg Config, consumer string) (int64, time.Duration, error) {
		fn := cfg.Function
		fn.Name = consumer
		wk, err := newWorker(ctx, cfg.Worker, fn)
		if err != nil {
			return 0, 0, err
		}
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
			select {
			case <-ctx.Done():
				return 0, 0, ctx.Err()
			case <-time.After(time.Millisecond):
			}
		}
		return wk.Stats().Applied.Load() - before, time.Since(start), nil
	}
}

// benchNaive is the baseline most consumers start with: a consumer group
// reader, and per record one transaction and one synchronous offset commit.
func benchNaive(ctx context.Context, cfg Config, consumer string) (int64, time.Duration, error) {
	pool, err := pgxpool.New(ctx, cfg.Worker.DatabaseURL)
	if err != nil {
		return 0, 0, err
	}
	defer pool.Close()
	_, dialer, err := kafkaconn.Kafka(cfg.Worker.KafkaSecurity)
	if err != nil {
		return 0, 0, err
	}
	reader := kafka.NewReader(kafka.ReaderConfig{
		Brokers: cfg.Worker.KafkaBrokers, Dialer: dialer, GroupID: consumer, Topic: cfg.Function.Topic,
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
		rec := engine.RecordFromKafka(msg)
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			rows, err := engine.HandleRecord(ctx, tx, cfg.Function, rec)
			if err != nil {
				return err
			}
			return outbox.Insert(ctx, tx, rows)
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
