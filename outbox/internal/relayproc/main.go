// Command relayproc is a test-support binary: one outbox relay process that
// the outbox fault tests start, SIGKILL at chosen points, and restart. It is
// not part of kfn's user-facing tools.
//
// Configuration is by environment variable:
//
//	KFN_DATABASE_URL        Postgres holding kfn.outbox (required)
//	KFN_NATS_URL            NATS server (required)
//	KFN_STREAM              stream name (default KFN_EVENTS)
//	KFN_SUBJECTS            comma-separated stream subjects (required)
//	KFN_BATCH               relay batch size (default: the relay's)
//	KFN_LEASE_GROUP         when set, shards are claimed through lease.Manager
//	                        in this group; otherwise the process works all
//	                        shards
//	KFN_MEMBER              lease member id (default: generated)
//	KFN_KILL_BEFORE_PUBLISH N: SIGKILL itself just before the Nth publish
//	KFN_KILL_AFTER_ACK      N: SIGKILL itself when the relay takes the Nth
//	                        stream ack (so after the publish, before the
//	                        row's delete)
//
// The fault points are found through the relay's publish spans
// (RelayConfig.Tracer): a span starts just before each publish and ends,
// without an error status, when the stream acks it.
//
// It prints "relay running" on stdout once the relay has started and exits
// 0 on SIGTERM or SIGINT.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/outbox"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "relayproc:", err)
		os.Exit(1)
	}
}

func run() error {
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	dbURL, natsURL := os.Getenv("KFN_DATABASE_URL"), os.Getenv("KFN_NATS_URL")
	if dbURL == "" || natsURL == "" || os.Getenv("KFN_SUBJECTS") == "" {
		return fmt.Errorf("KFN_DATABASE_URL, KFN_NATS_URL and KFN_SUBJECTS are required")
	}
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return fmt.Errorf("connect to Postgres: %w", err)
	}
	defer pool.Close()
	nc, err := nats.Connect(natsURL, nats.Name("relayproc"), nats.MaxReconnects(-1),
		nats.ReconnectWait(100*time.Millisecond), nats.RetryOnFailedConnect(true))
	if err != nil {
		return fmt.Errorf("connect to NATS: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	cfg := outbox.RelayConfig{
		Pool:      pool,
		JetStream: js,
		Stream:    os.Getenv("KFN_STREAM"),
		Subjects:  strings.Split(os.Getenv("KFN_SUBJECTS"), ","),
		BatchSize: int(envInt("KFN_BATCH")),
		RetryMax:  time.Second,
		Logger:    log,
		Tracer: &faultTracer{
			killBeforePublish: envInt("KFN_KILL_BEFORE_PUBLISH"),
			killAfterAck:      envInt("KFN_KILL_AFTER_ACK"),
		},
	}
	if group := os.Getenv("KFN_LEASE_GROUP"); group != "" {
		mgr, err := lease.NewManager(ctx, js, lease.Config{
			Group:    group,
			MemberID: os.Getenv("KFN_MEMBER"),
			Logger:   log,
		})
		if err != nil {
			return err
		}
		cfg.Scheduler = engine.LeasedShards(mgr, log)
	}
	relay, err := outbox.NewRelay(cfg)
	if err != nil {
		return err
	}
	fmt.Println("relay running")
	return relay.Run(ctx)
}

func envInt(name string) int64 {
	n, _ := strconv.ParseInt(os.Getenv(name), 10, 64)
	return n
}

// faultTracer kills the process at a chosen publish or ack: the relay
// starts a span just before each publish and ends it when the ack or the
// failure comes in.
type faultTracer struct {
	noop.Tracer
	killBeforePublish int64
	killAfterAck      int64
	publishes         atomic.Int64
	acks              atomic.Int64
}

func (f *faultTracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if n := f.publishes.Add(1); n == f.killBeforePublish {
		killSelf()
	}
	ctx, span := f.Tracer.Start(ctx, name, opts...)
	return ctx, &faultSpan{Span: span, tracer: f}
}

// faultSpan is one publish: an error status marks a failed one.
type faultSpan struct {
	trace.Span
	tracer *faultTracer
	failed bool
}

func (s *faultSpan) SetStatus(code codes.Code, description string) {
	s.failed = code == codes.Error
	s.Span.SetStatus(code, description)
}

func (s *faultSpan) End(opts ...trace.SpanEndOption) {
	if !s.failed && s.tracer.killAfterAck > 0 && s.tracer.acks.Add(1) == s.tracer.killAfterAck {
		killSelf()
	}
	s.Span.End(opts...)
}

func killSelf() {
	fmt.Fprintln(os.Stderr, "relayproc: fault point reached, SIGKILL")
	syscall.Kill(os.Getpid(), syscall.SIGKILL) //nolint:errcheck // we are dying either way
	select {}
}
