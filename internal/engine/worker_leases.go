package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/internal/naming"
	"github.com/kfn-dev/kfn/internal/redact"
	"github.com/kfn-dev/kfn/internal/settings"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// leaseStoreConfig derives the lease timing from the worker config; the
// safety margin is lease's default for the TTL (lease.SafetyMarginFor).
func leaseStoreConfig(cfg kfn.Config) lease.StoreConfig {
	return lease.StoreConfig{Bucket: cfg.LeaseBucket, TTL: cfg.LeaseTTL, Logger: cfg.Logger,
		Replicas: cfg.NATSReplicas, NoCreate: cfg.NATSProvisioned}.WithDefaults()
}

// leaseConfig is the configuration of every lease manager of this worker
// (lanes and relay shards): the bucket's timing, the token floor from
// Postgres, and the health hook, so that a worker that cannot reach
// Postgres hands its lanes and shards to one that can.
func (w *worker) leaseConfig(group string, log *slog.Logger) lease.Config {
	sc := leaseStoreConfig(w.cfg)
	return lease.Config{
		Bucket:       sc.Bucket,
		Group:        group,
		MemberID:     w.cfg.WorkerID,
		TTL:          sc.TTL,
		SafetyMargin: sc.SafetyMargin,
		RenewEvery:   w.cfg.LeaseRenew,
		Logger:       log,
		TokenFloor:   TokenFloor(w.pool),
		Replicas:     sc.Replicas,
		NoCreate:     sc.NoCreate,
		Healthy:      w.health.Healthy,
	}
}

// TokenFloor returns the lease store's TokenFloor hook: the largest fencing
// token stored in Postgres (the lanes' epochs and the WAL slot's fence). A lease bucket created (again) starts its tokens
// above it, so that the claims that follow are not refused as stale (see
// package lease, "Bucket lost").
func TokenFloor(db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) func(context.Context) (uint64, error) {
	return func(ctx context.Context) (uint64, error) {
		var epoch int64
		if err := db.QueryRow(ctx, `SELECT greatest((SELECT coalesce(max(epoch), 0) FROM kfn.cursors), (SELECT coalesce(max(fence_token), 0) FROM kfn.wal_outbox))`).Scan(&epoch); err != nil {
			return 0, fmt.Errorf("read the largest epoch of kfn.cursors and fence of kfn.wal_outbox: %w", err)
		}
		return uint64(max(epoch, 0)), nil
	}
}

// newPartitionLeases makes the lease manager that decides which of fn's
// partitions this worker owns.
func (w *worker) newPartitionLeases(ctx context.Context, fn kfn.Function) (*lease.Manager, error) {
	mgr, err := lease.NewManager(ctx, w.js, w.leaseConfig(naming.LeaseGroup(w.installation, fn.Name, Source(fn)), w.cfg.Logger.With("function", fn.Name)))
	if err != nil {
		return nil, fmt.Errorf("function %s: partition leases in NATS at %s: %w", fn.Name, redact.Redact(w.cfg.NATSURL), w.explainNATSState(err))
	}
	return mgr, nil
}

// ReplicasSetting adds to an error holding a *lease.ReplicasError the
// setting that asked for replicas.
func ReplicasSetting(err error, replicas int) error {
	var re *lease.ReplicasError
	if !errors.As(err, &re) {
		return err
	}
	return fmt.Errorf("%w; --%s (%s) is %d", err, settings.NATSReplicas.Flag, settings.NATSReplicas.Env, replicas)
}

// explainNATSState says which setting or command fixes an error about the
// JetStream state kfn keeps (the lease bucket, the event stream).
func (w *worker) explainNATSState(err error) error {
	switch {
	case errors.As(err, new(*lease.ReplicasError)):
		return ReplicasSetting(err, w.cfg.NATSReplicas)
	case w.cfg.NATSReplicas > 1 && (strings.Contains(err.Error(), "replicas > 1 not supported") || strings.Contains(err.Error(), "insufficient resources")):
		return fmt.Errorf("--%s (%s) %d needs a NATS cluster of at least %d servers with JetStream: %w",
			settings.NATSReplicas.Flag, settings.NATSReplicas.Env, w.cfg.NATSReplicas, w.cfg.NATSReplicas, err)
	case w.cfg.NATSProvisioned && errors.Is(err, jetstream.ErrBucketNotFound):
		return fmt.Errorf("lease bucket %s does not exist, and with --%s (%s) workers never create it: create it with `kfn migrate --nats --lease-bucket %s --nats-replicas %d` run by a NATS user allowed to create streams: %w",
			w.cfg.LeaseBucket, settings.NATSProvisioned.Flag, settings.NATSProvisioned.Env, w.cfg.LeaseBucket, w.cfg.NATSReplicas, err)
	case w.cfg.NATSProvisioned && errors.Is(err, jetstream.ErrStreamNotFound):
		return fmt.Errorf("event stream %s does not exist, and with --%s (%s) workers never create it: create it with `kfn migrate --nats --event-stream %s --subjects …` (the subjects the functions emit) run by a NATS user allowed to create streams: %w",
			w.cfg.EventStream, settings.NATSProvisioned.Flag, settings.NATSProvisioned.Env, w.cfg.EventStream, err)
	case errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded):
		// The server answers a denied request with an error on the
		// connection, not to the request, which then times out.
		if last := w.nc.LastError(); errors.Is(last, nats.ErrPermissionViolation) {
			return fmt.Errorf("this NATS user may not create or change the lease bucket %s or the event stream %s (%v): create them once with `kfn migrate --nats` run by a NATS user allowed to, and start the workers with --%s (%s): %w",
				w.cfg.LeaseBucket, w.cfg.EventStream, last, settings.NATSProvisioned.Flag, settings.NATSProvisioned.Env, err)
		}
		return fmt.Errorf("%w (is JetStream enabled, and may this NATS user create streams? If not, create the lease bucket and the event stream once with `kfn migrate --nats` and start the workers with --%s (%s))", err, settings.NATSProvisioned.Flag, settings.NATSProvisioned.Env)
	}
	return err
}

// own runs the lanes of fn that the lease manager hands this worker, each in
// its own goroutine, until ctx ends: the partitions of a Kafka topic, or the
// Lanes lanes of a JetStream subject (a key's events all go to one lane,
// which keeps their order).
func (w *worker) own(ctx context.Context, fn kfn.Function, leases *lease.Manager) error {
	items := func(ctx context.Context) ([]string, error) {
		parts, err := w.kafka.Partitions(ctx, fn.Topic)
		if err != nil {
			return nil, err
		}
		items := make([]string, len(parts))
		for i, p := range parts {
			items[i] = naming.LeaseItem(p)
		}
		return items, nil
	}
	run := w.runPartition
	if fn.Subject != "" {
		lanes := make([]string, w.cfg.Lanes)
		for k := range lanes {
			lanes[k] = naming.LeaseItem(int32(k))
		}
		items = func(context.Context) ([]string, error) { return lanes, nil }
		run = w.runSubject
	}
	return leases.Run(ctx, items, func(ctx context.Context, c lease.Claim) {
		w.start.phase(phaseLease, w.runBegan)
		p, err := naming.ParseLeaseItem(c.Item)
		if err != nil {
			w.cfg.Logger.Error("ignoring lease", "function", fn.Name, "err", err)
			return
		}
		run(ctx, fn, p, int64(c.Token))
	})
}
