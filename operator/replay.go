package operator

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/runtime/lease"
)

// ReplayRequest asks to move one partition of a function back to an offset.
type ReplayRequest struct {
	Function  string
	Topic     string
	Partition int32
	From      int64
	// Reexecute applies handled records again (audited, needs a Reason).
	// Without it the replay is idempotent: handled records are skipped.
	Reexecute bool
	Reason    string
	Actor     string
	// LeaseBucket is the workers' --lease-bucket; default lease.DefaultBucket.
	LeaseBucket string
}

// Replay moves a partition's cursor through the same fencing the workers
// use (see withSeizedPartition), and writes the audit log in the same
// transaction. A worker then takes the partition again and resumes at the
// new cursor.
func Replay(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, req ReplayRequest) (inbox.ReplayResult, error) {
	part := inbox.Partition{Consumer: req.Function, Topic: req.Topic, Partition: req.Partition}
	var res inbox.ReplayResult
	err := withSeizedPartition(ctx, pool, js, req.LeaseBucket, part, req.Actor, func(tx pgx.Tx, token int64) (err error) {
		res, err = inbox.Replay(ctx, tx, inbox.ReplayRequest{
			Partition: part, Token: token, From: req.From,
			Reexecute: req.Reexecute, Actor: req.Actor, Reason: req.Reason,
		})
		return err
	})
	return res, err
}

// withSeizedPartition runs an operator's change to a partition under the
// workers' own fencing: it seizes the partition's lease (a new, larger
// token), records that token in Postgres (so the current owner's next
// commit fails), runs change in the same transaction, then releases the
// lease so that a worker takes the partition again at once.
func withSeizedPartition(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, bucket string, part inbox.Partition, actor string,
	change func(tx pgx.Tx, token int64) error) error {
	if bucket == "" {
		bucket = lease.DefaultBucket
	}
	if _, err := inbox.ReadCursor(ctx, pool, part); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("partition %s has no cursor: check the function, topic and partition (kfn status lists them)", part)
		}
		return err
	}
	store, err := lease.OpenExisting(ctx, js, bucket, slog.Default())
	if err != nil {
		return fmt.Errorf("partition leases (is --lease-bucket the workers' one?): %w", err)
	}
	installation, err := engine.InstallationID(ctx, pool)
	if err != nil {
		return err
	}
	l, err := store.Seize(ctx, engine.LeaseGroup(installation, part.Consumer, part.Topic), engine.LeaseItem(part.Partition), actor)
	if err != nil {
		return fmt.Errorf("take the lease of %s: %w", part, err)
	}
	defer store.Release(context.WithoutCancel(ctx), l) //nolint:errcheck // if it fails the lease expires after its TTL

	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// A worker frozen inside a batch holds the cursor row; do not wait
		// for it forever (the workers' next claim ends its session).
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '10s'`); err != nil {
			return err
		}
		if _, err := inbox.ClaimPartition(ctx, tx, part, int64(l.Token), actor, 0); err != nil {
			return err
		}
		return change(tx, int64(l.Token))
	})
}
