package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"

	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/internal/naming"
	"github.com/kfn-dev/kfn/internal/redact"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// emittedSubjects is the union of the subjects fns declare in Emits.
func emittedSubjects(fns []kfn.Function) []string {
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
	var all []string
	var err error
	if w.cfg.NATSProvisioned {
		all, err = outbox.ProvisionedStream(ctx, w.js, w.cfg.EventStream, subjects, w.cfg.NATSReplicas)
		var mismatch *outbox.StreamMismatchError
		if errors.As(err, &mismatch) {
			err = fmt.Errorf("%w (with --%s, add it with `kfn migrate --nats --subjects …`)", err, settings.NATSProvisioned.Flag)
		}
	} else {
		all, err = outbox.ExtendStream(ctx, w.js, w.cfg.EventStream, subjects,
			outbox.StreamLimits{Duplicates: w.cfg.EventDedup, MaxAge: w.cfg.EventRetention, Replicas: w.cfg.NATSReplicas})
	}
	if err != nil {
		return nil, fmt.Errorf("event stream %s in NATS at %s: %w", w.cfg.EventStream, redact.Redact(w.cfg.NATSURL), w.explainNATSState(err))
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
	shards, err := lease.NewManager(ctx, w.js, w.leaseConfig(naming.RelayLeaseGroup(w.installation), w.cfg.Logger.With("component", "outbox-relay")))
	if err != nil {
		return nil, fmt.Errorf("relay shard leases: %w", w.explainNATSState(err))
	}
	slotLog := w.cfg.Logger.With("component", "outbox-relay", "reader", "wal-slot")
	slot, err := lease.NewManager(ctx, w.js, w.leaseConfig(naming.WALRelayLeaseGroup(w.installation), slotLog))
	if err != nil {
		return nil, fmt.Errorf("WAL outbox slot lease: %w", w.explainNATSState(err))
	}
	return outbox.NewRelay(outbox.RelayConfig{
		Pool: w.pool, JetStream: w.js, Stream: w.cfg.EventStream, Subjects: streamSubjects,
		Duplicates: w.cfg.EventDedup, MaxAge: w.cfg.EventRetention, Replicas: w.cfg.NATSReplicas, Logger: w.cfg.Logger,
		Scheduler: LeasedShards(shards, w.cfg.Logger.With("component", "outbox-relay")),
		Tracer:    w.tracer,
		Mode:      outboxMode(&w.cfg), SlotLease: LeasedSlot(slot, slotLog), WorkerID: w.cfg.WorkerID,
	})
}

// leasedSlot hands this process the WAL outbox's slot while it holds the
// one lease of the installation's WAL relay group: of all the workers and
// kfn relay processes, one reads the slot at a time, and the lease's token
// fences the reader it replaces (see outbox.SlotLease).
type leasedSlot struct {
	leases *lease.Manager
	log    *slog.Logger
}

// LeasedSlot is the WAL slot lease of kfn's workers: leases is a lease
// manager of the installation's WAL relay group.
func LeasedSlot(leases *lease.Manager, log *slog.Logger) outbox.SlotLease {
	return leasedSlot{leases: leases, log: log}
}

// walSlotItem is the one item of the WAL relay lease group.
const walSlotItem = "slot"

func (s leasedSlot) Run(ctx context.Context, work func(ctx context.Context, token uint64)) error {
	items := func(context.Context) ([]string, error) { return []string{walSlotItem}, nil }
	return s.leases.Run(ctx, items, func(ctx context.Context, c lease.Claim) {
		s.log.Debug("WAL outbox slot leased", "token", c.Token)
		work(ctx, c.Token)
	})
}

// leasedShards hands this process the relay shards it holds NATS leases
// on, one lease per shard in the installation's relay group, so that the
// relays of all workers (and kfn relay processes) split the shards and
// each shard has one relay at a time.
type leasedShards struct {
	leases *lease.Manager
	log    *slog.Logger
}

// LeasedShards is the relay shard scheduler of kfn's workers: leases is a
// lease manager of the installation's relay group (or any group all the
// relays of one outbox share).
func LeasedShards(leases *lease.Manager, log *slog.Logger) outbox.ShardScheduler {
	return leasedShards{leases: leases, log: log}
}

func (s leasedShards) Run(ctx context.Context, work func(ctx context.Context, shard int)) error {
	items := func(context.Context) ([]string, error) { return shardItems(), nil }
	return s.leases.Run(ctx, items, func(ctx context.Context, c lease.Claim) {
		shard, err := parseShardItem(c.Item)
		if err != nil {
			s.log.Error("lease manager handed out an item that is not a relay shard", "item", c.Item, "err", err)
			return
		}
		s.log.Debug("relay shard leased", "shard", shard, "token", c.Token)
		work(ctx, shard)
	})
}

// shardItem is the lease item of a relay shard: "shard-07".
func shardItem(shard int) string { return fmt.Sprintf("shard-%02d", shard) }

// parseShardItem is the inverse of shardItem.
func parseShardItem(item string) (int, error) {
	n, err := strconv.Atoi(strings.TrimPrefix(item, "shard-"))
	if err != nil || !strings.HasPrefix(item, "shard-") || n < 0 || n >= outbox.Shards {
		return 0, fmt.Errorf("%q is not a relay shard item (shard-00 to shard-%02d)", item, outbox.Shards-1)
	}
	return n, nil
}

// shardItems lists the lease items of all relay shards.
func shardItems() []string {
	items := make([]string, outbox.Shards)
	for i := range items {
		items[i] = shardItem(i)
	}
	return items
}
