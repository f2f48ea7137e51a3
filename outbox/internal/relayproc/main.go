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
//	KFN_KILL_AFTER_ACK      N: SIGKILL itself when the Nth stream ack
//	                        arrives, before the relay sees it (so after the
//	                        publish, before the row's delete)
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

	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/lease"
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
	faulty := &faultyJetStream{
		JetStream:         js,
		killBeforePublish: envInt("KFN_KILL_BEFORE_PUBLISH"),
		killAfterAck:      envInt("KFN_KILL_AFTER_ACK"),
	}

	cfg := outbox.RelayConfig{
		Pool:      pool,
		JetStream: faulty,
		Stream:    os.Getenv("KFN_STREAM"),
		Subjects:  strings.Split(os.Getenv("KFN_SUBJECTS"), ","),
		BatchSize: int(envInt("KFN_BATCH")),
		RetryMax:  time.Second,
		Logger:    log,
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

// faultyJetStream kills the process at a chosen publish or ack.
type faultyJetStream struct {
	jetstream.JetStream
	killBeforePublish int64
	killAfterAck      int64
	publishes         atomic.Int64
	acks              atomic.Int64
}

func (f *faultyJetStream) PublishMsgAsync(m *nats.Msg, opts ...jetstream.PublishOpt) (jetstream.PubAckFuture, error) {
	if n := f.publishes.Add(1); n == f.killBeforePublish {
		killSelf()
	}
	ack, err := f.JetStream.PublishMsgAsync(m, opts...)
	if err != nil || f.killAfterAck == 0 {
		return ack, err
	}
	return f.watch(ack), nil
}

// watch passes an ack future's outcome on, unless it is the ack to die at.
func (f *faultyJetStream) watch(inner jetstream.PubAckFuture) jetstream.PubAckFuture {
	out := &relayedFuture{inner: inner, ok: make(chan *jetstream.PubAck, 1), err: make(chan error, 1)}
	go func() {
		select {
		case ack := <-inner.Ok():
			if f.acks.Add(1) == f.killAfterAck {
				killSelf()
			}
			out.ok <- ack
		case err := <-inner.Err():
			out.err <- err
		}
	}()
	return out
}

type relayedFuture struct {
	inner jetstream.PubAckFuture
	ok    chan *jetstream.PubAck
	err   chan error
}

func (r *relayedFuture) Ok() <-chan *jetstream.PubAck { return r.ok }
func (r *relayedFuture) Err() <-chan error            { return r.err }
func (r *relayedFuture) Msg() *nats.Msg               { return r.inner.Msg() }

func killSelf() {
	fmt.Fprintln(os.Stderr, "relayproc: fault point reached, SIGKILL")
	syscall.Kill(os.Getpid(), syscall.SIGKILL) //nolint:errcheck // we are dying either way
	select {}
}
