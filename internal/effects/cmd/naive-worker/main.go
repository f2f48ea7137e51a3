// Command naive-worker is the baseline that kfn's fault tests compare with:
// a plain Kafka consumer group member (a kafka-go Reader with a GroupID)
// that applies each record in its own Postgres transaction, with no inbox
// and no fence, and then commits the record's offset synchronously. This is
// the usual "commit after the work" consumer, which is at-least-once: a
// member that pauses past its session timeout and wakes up goes on applying
// records from partitions that were handed to another member.
//
// It writes the same effects rows as the effects test function, so the same
// checker counts what it gets wrong. Configuration: DATABASE_URL,
// KFN_KAFKA_BROKERS, KFN_TEST_FUNCTION (the consumer group and the effects
// table), KFN_TEST_TOPIC, and KFN_WORKER_ID for the logs. Every second it
// logs a "progress" line listing the partitions it applied records of since
// the previous one; SIGTERM stops it cleanly.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/effects"
)

// Consumer group timing: the session timeout is the broker's default
// minimum (group.min.session.timeout.ms), the heartbeat the usual third of
// it or less.
const (
	sessionTimeout    = 6 * time.Second
	heartbeatInterval = time.Second
)

func main() {
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	if err := run(log); err != nil {
		log.Error("naive worker failed", "err", err)
		os.Exit(1)
	}
}

func run(log *slog.Logger) error {
	fn, topic := os.Getenv("KFN_TEST_FUNCTION"), os.Getenv("KFN_TEST_TOPIC")
	dbURL, brokers := os.Getenv("DATABASE_URL"), strings.Split(os.Getenv("KFN_KAFKA_BROKERS"), ",")
	if fn == "" || topic == "" || dbURL == "" || brokers[0] == "" {
		fmt.Fprintln(os.Stderr, "naive-worker: set KFN_TEST_FUNCTION, KFN_TEST_TOPIC, DATABASE_URL and KFN_KAFKA_BROKERS")
		os.Exit(2)
	}
	log = log.With("worker", os.Getenv("KFN_WORKER_ID"), "group", fn)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	pgCfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return fmt.Errorf("parse DATABASE_URL: %w", err)
	}
	pgCfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, pgCfg)
	if err != nil {
		return fmt.Errorf("connect to Postgres: %w", err)
	}
	defer pool.Close()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return effects.Function(fn, topic).Setup(ctx, tx) }); err != nil {
		return fmt.Errorf("create the effects table: %w", err)
	}

	reader := kafka.NewReader(kafka.ReaderConfig{
		Brokers:           brokers,
		GroupID:           fn,
		Topic:             topic,
		StartOffset:       kafka.FirstOffset,
		MinBytes:          1,
		MaxBytes:          4 << 20,
		MaxWait:           250 * time.Millisecond,
		SessionTimeout:    sessionTimeout,
		HeartbeatInterval: heartbeatInterval,
		RebalanceTimeout:  10 * time.Second,
		JoinGroupBackoff:  time.Second,
		CommitInterval:    0, // CommitMessages commits synchronously
		ErrorLogger: kafka.LoggerFunc(func(msg string, args ...any) {
			log.Debug("kafka reader: " + fmt.Sprintf(msg, args...))
		}),
	})
	defer reader.Close()

	p := &progress{partitions: map[int]bool{}}
	go p.report(ctx, log)
	log.Info("naive worker started", "topic", topic, "session_timeout", sessionTimeout, "heartbeat", heartbeatInterval)
	for {
		msg, err := reader.FetchMessage(ctx)
		if ctx.Err() != nil {
			break
		}
		if err != nil {
			log.Warn("fetch failed", "err", err)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if err := apply(ctx, log, pool, fn, msg); err != nil {
			break // ctx ended
		}
		p.applied(msg.Partition)
		if err := reader.CommitMessages(ctx, msg); err != nil && ctx.Err() == nil {
			p.commitFailed()
			log.Warn("commit offset failed", "partition", msg.Partition, "offset", msg.Offset, "err", err)
		}
	}
	log.Info("naive worker stopped")
	return nil
}

// apply writes the record's effect row in one transaction, retrying until
// it commits or ctx ends: the offset is committed only after the effect.
func apply(ctx context.Context, log *slog.Logger, pool *pgxpool.Pool, fn string, msg kafka.Message) error {
	for {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+effects.Table(fn)+` (topic, partition, "offset", value, attempt) VALUES ($1, $2, $3, $4, 1)`,
				msg.Topic, msg.Partition, msg.Offset, msg.Value)
			return err
		})
		if err == nil || ctx.Err() != nil {
			return err
		}
		log.Warn("apply failed, retrying", "partition", msg.Partition, "offset", msg.Offset, "err", err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// progress is what the worker did since its last progress line.
type progress struct {
	mu             sync.Mutex
	partitions     map[int]bool
	total          int
	commitFailures int
}

func (p *progress) applied(partition int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.partitions[partition] = true
	p.total++
}

func (p *progress) commitFailed() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.commitFailures++
}

func (p *progress) report(ctx context.Context, log *slog.Logger) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		p.mu.Lock()
		parts := slices.Sorted(maps.Keys(p.partitions))
		clear(p.partitions)
		total, failures := p.total, p.commitFailures
		p.mu.Unlock()
		log.Info("progress", "partitions", parts, "applied", total, "commit_failures", failures)
	}
}
