package engine

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/kfn-dev/kfn/internal/observe"
	"github.com/kfn-dev/kfn/internal/preflight"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// Relay is an installation's outbox relay running on its own, outside any
// worker (`kfn relay`, next to workers started with --no-relay). It competes
// for the same relay shard leases as the workers' relays, so each shard has
// one relay at a time wherever it runs.
type Relay struct {
	w *worker
}

// NewRelay connects to Postgres and NATS as cfg says (its Kafka and batching
// settings are not used), checks the schema version, makes cfg.EventStream
// capture subjects and returns a relay that works the shards it leases.
func NewRelay(ctx context.Context, cfg kfn.Config, subjects []string) (*Relay, error) {
	cfg = cfg.WithDefaults()
	if err := preflight.ValidateConfig(cfg, false); err != nil {
		return nil, err
	}
	if len(subjects) == 0 {
		return nil, preflight.ConfigErrorOf(settings.RelaySubjects, "list the subjects the functions emit on, e.g. orders.accepted,payments.>")
	}
	var errs []error
	for _, s := range subjects {
		if err := outbox.CheckSubjectPattern(s); err != nil {
			errs = append(errs, preflight.ConfigErrorOf(settings.RelaySubjects, "%s", err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	w := &worker{cfg: cfg, stats: &observe.Stats{}}
	if err := w.startTracing(ctx, "kfn-relay"); err != nil {
		return nil, err
	}
	if err := w.connectPostgres(ctx); err != nil {
		w.close()
		return nil, err
	}
	if err := w.connectNATS(); err != nil {
		w.close()
		return nil, err
	}
	relay, err := w.newRelay(ctx, subjects)
	if err != nil {
		w.close()
		return nil, fmt.Errorf("outbox relay: %w", err)
	}
	w.relay = relay
	return &Relay{w: w}, nil
}

// Run relays until ctx ends, then releases its shards and closes its
// connections.
func (r *Relay) Run(ctx context.Context) error {
	defer r.w.close()
	defer r.w.health.Start(ctx)()
	rctx, stopReadiness := context.WithCancel(ctx)
	readinessDone := make(chan struct{})
	go func() {
		defer close(readinessDone)
		r.w.watchReadiness(rctx)
	}()
	defer func() { stopReadiness(); <-readinessDone }()
	return r.w.relay.Run(ctx)
}

// HTTPHandler serves the relay's Prometheus metrics at /metrics (the
// outbox counters, the commit-to-ack latency histogram and the outbox
// backlog gauges, as a worker's), /healthz and /readyz (Postgres with a
// compatible schema and NATS JetStream answer; probed every 2 s while Run
// runs).
func (r *Relay) HTTPHandler() http.Handler { return r.w.httpHandler(r.w.serveReadiness) }

// Stats returns the relay's counters.
func (r *Relay) Stats() outbox.RelayStats { return r.w.relay.Stats() }
