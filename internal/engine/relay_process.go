package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
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
func NewRelay(ctx context.Context, cfg Config, subjects []string) (*Relay, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(false); err != nil {
		return nil, err
	}
	if len(subjects) == 0 {
		return nil, configError(settings.RelaySubjects, "list the subjects the functions emit on, e.g. orders.accepted,payments.>")
	}
	var errs []error
	for _, s := range subjects {
		if err := outbox.CheckSubjectPattern(s); err != nil {
			errs = append(errs, configError(settings.RelaySubjects, "%s", err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	w := &worker{cfg: cfg, stats: &Stats{}}
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
	defer r.w.runHealth(ctx)()
	return r.w.relay.Run(ctx)
}

// Stats returns the relay's counters.
func (r *Relay) Stats() outbox.RelayStats { return r.w.relay.Stats() }
