package schema

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// MigrateTo is Migrate up to a version, for tests of one migration.
func MigrateTo(ctx context.Context, pool *pgxpool.Pool, target int) ([]int, error) {
	return migrateTo(ctx, pool, target, migrateOptions{})
}

// MigrateOffline is Migrate applying migration 0012 without copying the
// inbox online first, as on a new database.
func MigrateOffline(ctx context.Context, pool *pgxpool.Pool) ([]int, error) {
	return MigrateToOffline(ctx, pool, Latest())
}

// MigrateToOffline is MigrateOffline up to a version.
func MigrateToOffline(ctx context.Context, pool *pgxpool.Pool, target int) ([]int, error) {
	return migrateTo(ctx, pool, target, migrateOptions{offline: true})
}

// MigrateOnline is MigrateReporting with batches of the online copy of
// batchRows rows.
func MigrateOnline(ctx context.Context, pool *pgxpool.Pool, batchRows int, progress func(Progress)) ([]int, error) {
	return migrateTo(ctx, pool, Latest(), migrateOptions{progress: progress, backfillRows: batchRows})
}

// MigrateWaiting is Migrate with lock waits of the online copy of at
// most wait at a time.
func MigrateWaiting(ctx context.Context, pool *pgxpool.Pool, wait time.Duration, progress func(Progress)) ([]int, error) {
	return migrateTo(ctx, pool, Latest(), migrateOptions{progress: progress, lockWait: wait})
}

// Compatibility reads a migration's marker.
var Compatibility = compatibility
