package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/internal/logsetup"
	"github.com/kfn-dev/kfn/internal/observe"
	"github.com/kfn-dev/kfn/internal/preflight"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

// runRelay runs the installation's outbox relay as a process of its own,
// for deployments whose workers run with --no-relay. It takes relay shards
// through the same leases as the workers' relays, so it can also run next
// to them.
func runRelay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("relay", help{
		usage: []string{"kfn relay --subjects S[,S…] [flags]"},
		text: `
Runs the outbox relay on its own, for workers that run none
(KFN_NO_RELAY=true): it shares the relay shard leases with any worker
relays, so each shard has one relay at a time. It logs like the workers:
JSON lines on stderr from --log-level up; its counters go to stdout.`,
		examples: `
kfn relay --subjects orders.accepted,payments.>
KFN_RELAY_SUBJECTS='orders.>' kfn relay`,
	}, stderr)
	cfg := bindRelayConfig(fs)
	subjects := bind(fs, settings.RelaySubjects)
	every := fs.Duration("stats-every", 5*time.Second, "how often to print the relay's counters")
	logLevel := bind(fs, settings.LogLevel)
	metricsAddr := bind(fs, settings.MetricsAddr)
	healthcheck := fs.Bool("healthcheck", false, observe.HealthcheckUsage)
	if err := parse(fs, args); err != nil {
		return err
	}
	if *healthcheck {
		return observe.ProbeReady(ctx, *metricsAddr)
	}
	if err := requiredSetting(settings.DatabaseURL, cfg.DatabaseURL); err != nil {
		return err
	}
	if err := requiredSetting(settings.NATSURL, cfg.NATSURL); err != nil {
		return err
	}
	subjectList := *subjects
	if len(subjectList) == 0 {
		return &usageError{msg: "--subjects is required: list the subjects the functions emit on, e.g. orders.accepted,payments.>"}
	}
	if *every <= 0 {
		return &usageError{msg: "--stats-every must be positive"}
	}
	if cfg.WorkerID == "" {
		host, _ := os.Hostname()
		cfg.WorkerID = fmt.Sprintf("kfn-relay-%s-%d", host, os.Getpid())
	}
	cfg.Logger = logsetup.New(stderr, logsetup.Level(*logLevel))
	relay, err := engine.NewRelay(ctx, *cfg, subjectList)
	var cfgErr *preflight.ConfigError
	if errors.As(err, &cfgErr) {
		return &usageError{msg: err.Error()}
	}
	if err != nil {
		return err
	}
	if *metricsAddr != "" {
		ln, err := net.Listen("tcp", *metricsAddr)
		if err != nil {
			return &usageError{msg: fmt.Sprintf("invalid --%s (%s) %q: %v", settings.MetricsAddr.Flag, settings.MetricsAddr.Env, *metricsAddr, err)}
		}
		srv := &http.Server{Handler: relay.HTTPHandler(), ReadHeaderTimeout: 5 * time.Second}
		go srv.Serve(ln)                         //nolint:errcheck // ends with Shutdown below
		defer srv.Shutdown(context.Background()) //nolint:errcheck // best effort at exit
		fmt.Fprintf(stdout, "kfn relay: serving /metrics, /healthz and /readyz on %s\n", ln.Addr())
	}
	fmt.Fprintf(stdout, "kfn relay: relaying the outbox to stream %s (subjects %s) as %s; Ctrl-C stops\n", cfg.WithDefaults().EventStream, strings.Join(subjectList, ","), cfg.WorkerID)

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

// bindRelayConfig binds the worker settings a relay uses (connections,
// worker id, statement timeout, leases, event stream) to the fields of the
// Config it returns; the batch, retry and handler settings are not its.
func bindRelayConfig(fs *flagSet) *runtime.Config {
	var cfg runtime.Config
	b := fs.settings
	settings.DatabaseURL.Bind(b, &cfg.DatabaseURL)
	bindNATSState(b, &cfg)
	settings.NATSProvisioned.Bind(b, &cfg.NATSProvisioned)
	id := settings.WorkerID
	id.DefaultText = "kfn-relay-host-pid"
	id.Bind(b, &cfg.WorkerID)
	st := settings.StatementTimeout
	st.DefaultText = fmt.Sprintf("0.4 × --lease-ttl, at most %s", settings.DefaultHandlerTimeout*8/10)
	st.Bind(b, &cfg.StatementTimeout)
	settings.LeaseRenew.Bind(b, &cfg.LeaseRenew)
	return &cfg
}

// bindNATSState binds the settings of a process that may create kfn's
// JetStream state: the NATS connection, the replicas, the lease bucket and
// its TTL, and the event stream with its limits.
func bindNATSState(b *settings.Binder, cfg *runtime.Config) {
	settings.NATSURL.Bind(b, &cfg.NATSURL)
	connect.BindNATSSecurity(b, &cfg.NATSSecurity)
	settings.NATSReplicas.Bind(b, &cfg.NATSReplicas)
	settings.LeaseBucket.Bind(b, &cfg.LeaseBucket)
	settings.LeaseTTL.Bind(b, &cfg.LeaseTTL)
	settings.EventStream.Bind(b, &cfg.EventStream)
	settings.EventDedup.Bind(b, &cfg.EventDedup)
	settings.EventRetention.Bind(b, &cfg.EventRetention)
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
	wal := ""
	if s.WAL.Reading || s.WAL.Read > 0 || s.WAL.SlotLost {
		wal = fmt.Sprintf("  wal: read %7d  unacked %5d  WAL held %d bytes", s.WAL.Read, s.WAL.Pending, s.WAL.HeldBytes)
		if s.WAL.SlotLost {
			wal += "  SLOT LOST"
		}
	}
	fmt.Fprintf(w, "[%6s] published %7d (%6.0f/s)  duplicates %4d  failures %4d  parked %3d  shards %2d  last commit→ack %8s  %s%s\n",
		elapsed, s.Published, rate, s.Duplicates, s.Failures, s.Parked, s.ActiveShards, latency, listen, wal)
}
