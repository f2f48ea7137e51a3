package engine

import (
	"context"
	"fmt"

	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/lease"
)

// emittedSubjects is the union of the subjects fns declare in Emits.
func emittedSubjects(fns []Function) []string {
	var out []string
	seen := map[string]bool{}
	for _, fn := range fns {
		for _, s := range fn.Emits {
			if !seen[s] {
				seen[s] = true
				out = append(out, s)
			}
		}
	}
	return out
}

// extendEventStream makes the event stream capture subjects, creating it if
// needed, and returns every subject it captures.
func (w *worker) extendEventStream(ctx context.Context, subjects []string) ([]string, error) {
	all, err := outbox.ExtendStream(ctx, w.js, w.cfg.EventStream, subjects,
		outbox.StreamLimits{Duplicates: w.cfg.EventDedup, MaxAge: w.cfg.EventRetention})
	if err != nil {
		return nil, fmt.Errorf("event stream %s in NATS at %s: %w", w.cfg.EventStream, w.cfg.NATSURL, err)
	}
	return all, nil
}

// newRelay makes the stream capture subjects and returns a relay that works
// the shards this process holds leases on.
func (w *worker) newRelay(ctx context.Context, subjects []string) (*outbox.Relay, error) {
	streamSubjects, err := w.extendEventStream(ctx, subjects)
	if err != nil {
		return nil, err
	}
	shards, err := lease.NewManager(w.js, w.leaseConfig(relayLeaseGroup(w.installation), w.cfg.Logger.With("component", "outbox-relay")))
	if err != nil {
		return nil, fmt.Errorf("relay shard leases: %w", err)
	}
	return outbox.NewRelay(outbox.RelayConfig{
		Pool: w.pool, JetStream: w.js, Stream: w.cfg.EventStream, Subjects: streamSubjects,
		Duplicates: w.cfg.EventDedup, MaxAge: w.cfg.EventRetention, Leases: shards, Logger: w.cfg.Logger,
	})
}
