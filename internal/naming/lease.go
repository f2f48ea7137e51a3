package naming

import (
	"context"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
)

// LeaseGroup is the lease group of a function's lanes: one lease per
// (function, topic or subject, partition), contended by the function's
// workers of one installation.
func LeaseGroup(installation, function, source string) string {
	return installation + "/" + function + "/" + source
}

// RelayLeaseGroup is the lease group of the outbox relay shards of an
// installation. Every worker and `kfn relay` process of the installation
// competes for the same shards, so each shard has one relay at a time.
func RelayLeaseGroup(installation string) string { return installation + "/outbox-relay" }

// WALRelayLeaseGroup is the lease group of the WAL outbox's slot reader
// of an installation: one item, so that one relay reads the slot at a time.
func WALRelayLeaseGroup(installation string) string { return installation + "/wal-relay" }

// LeaseItem is the item of a lane's lease in its group: the partition (a
// Kafka partition, or a NATS lane's number).
func LeaseItem(partition int32) string { return strconv.Itoa(int(partition)) }

// ParseLeaseItem is the partition of a lease item (LeaseItem's inverse).
func ParseLeaseItem(item string) (int32, error) {
	p, err := strconv.ParseInt(item, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("lease item %q is not a partition number", item)
	}
	return int32(p), nil
}

// InstallationID reads the id that scopes an installation's lease groups.
func InstallationID(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (string, error) {
	var id string
	if err := db.QueryRow(ctx, `SELECT id::text FROM kfn.installation`).Scan(&id); err != nil {
		return "", fmt.Errorf("read the installation id from kfn.installation: %w", err)
	}
	return id, nil
}
