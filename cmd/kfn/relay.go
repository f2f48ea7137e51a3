package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

// runRelay runs the installation's outbox relay as a process of its own,
// for deployments whose workers run with --no-relay. It takes relay shards
// through the same leases as the workers' relays, so it can also run next
// to them.
func runRelay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("relay", stderr)
	dbURL := databaseFlag(fs)
	natsURL := natsFlag(fs)
	bucket := leaseBucketFlag(fs)
	subjects := fs.String("subjects", env("", "KFN_RELAY_SUBJECTS"), "comma-separated subjects the functions emit on (wildcards allowed); the event stream is created or extended to capture them [KFN_RELAY_SUBJECTS]")
	stream := fs.String("event-stream", env(runtime.DefaultStream, "KFN_EVENT_STREAM"), "JetStream stream the events are relayed to [KFN_EVENT_STREAM]")
	workerID := fs.String("worker-id", env("", "KFN_WORKER_ID"), "this relay's lease member id (default kfn-relay-host-pid) [KFN_WORKER_ID]")
	var envErrs []error
	dedup := durationFlag(fs, &envErrs, "event-dedup", "KFN_EVENT_DEDUP", runtime.DefaultEventDedup, "duplicate window of the event stream when the relay creates it")
	ttl := durationFlag(fs, &envErrs, "lease-ttl", "KFN_LEASE_TTL", runtime.DefaultLeaseTTL, "shard lease lifetime without renewal; the workers' value")
	renew := durationFlag(fs, &envErrs, "lease-renew", "KFN_LEASE_RENEW", runtime.DefaultLeaseRenew, "shard lease renewal interval; the workers' value")
	every := fs.Duration("stats-every", 5*time.Second, "how often to print the relay's counters")
	verbose := fs.Bool("v", false, "show the relay's logs")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := errors.Join(envErrs...); err != nil {
		return &usageError{msg: err.Error()}
	}
	if err := required("database-url", *dbURL); err != nil {
		return err
	}
	if err := required("nats-url", *natsURL); err != nil {
		return err
	}
	subjectList := splitBrokers(*subjects) // a comma-separated list, like --kafka-brokers
	if len(subjectList) == 0 {
		return &usageError{msg: "--subjects is required: list the subjects the functions emit on, e.g. orders.accepted,payments.>"}
	}
	if *every <= 0 {
		return &usageError{msg: "--stats-every must be positive"}
	}
	id := *workerID
	if id == "" {
		host, _ := os.Hostname()
		id = fmt.Sprintf("kfn-relay-%s-%d", host, os.Getpid())
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelInfo
	}
	cfg := runtime.Config{
		DatabaseURL: *dbURL, NATSURL: *natsURL, WorkerID: id,
		LeaseBucket: *bucket, LeaseTTL: *ttl, LeaseRenew: *renew,
		EventStream: *stream, EventDedup: *dedup,
		Logger: slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level})),
	}
	relay, err := runtime.NewRelay(ctx, cfg, subjectList)
	var cfgErr *runtime.ConfigError
	if errors.As(err, &cfgErr) {
		return &usageError{msg: err.Error()}
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "kfn relay: relaying the outbox to stream %s (subjects %s) as %s; Ctrl-C stops\n", *stream, strings.Join(subjectList, ","), id)

	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	ticker := time.NewTicker(*every)
	defer ticker.Stop()
	start := time.Now()
	var last outbox.RelayStats
	lastAt := start
	for {
		select {
		case err := <-done:
			s := relay.Stats()
			printRelayStats(stdout, time.Since(start).Round(min(*every, time.Second)), s, last, time.Since(lastAt))
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "kfn relay: stopped cleanly after publishing %d events (%d duplicates dropped by the stream)\n", s.Published, s.Duplicates)
			return nil
		case <-ticker.C:
			s := relay.Stats()
			printRelayStats(stdout, time.Since(start).Round(min(*every, time.Second)), s, last, time.Since(lastAt))
			last, lastAt = s, time.Now()
		}
	}
}

// printRelayStats prints one line of relay counters; the rate is over the
// interval since prev.
func printRelayStats(w io.Writer, elapsed time.Duration, s, prev outbox.RelayStats, interval time.Duration) {
	rate := 0.0
	if interval > 0 {
		rate = float64(s.Published-prev.Published) / interval.Seconds()
	}
	latency := "-"
	if !s.LastPublishedAt.IsZero() {
		latency = s.LastLatency.Round(100 * time.Microsecond).String()
	}
	listen := "listening"
	if !s.Listening {
		listen = "polling"
	}
	fmt.Fprintf(w, "[%6s] published %7d (%6.0f/s)  duplicates %4d  failures %4d  parked %3d  shards %2d  last commit→ack %8s  %s\n",
		elapsed, s.Published, rate, s.Duplicates, s.Failures, s.Parked, s.ActiveShards, latency, listen)
}

// durationFlag defines a duration flag whose default comes from the
// environment variable env; a malformed environment value is added to errs.
func durationFlag(fs *flag.FlagSet, errs *[]error, name, env string, def time.Duration, usage string) *time.Duration {
	if v := os.Getenv(env); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			*errs = append(*errs, fmt.Errorf("%s=%q is not a duration like 500ms or 5s", env, v))
		} else {
			def = d
		}
	}
	return fs.Duration(name, def, usage+" ["+env+"]")
}
