// Package schema owns kfn's Postgres schema: the numbered SQL migrations
// embedded in every kfn binary, the migrator that applies them, and the
// start-up check that refuses to run against a schema this binary does not
// know.
package schema

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migration is one numbered SQL file.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// ErrSchemaMissing means kfn's tables do not exist in the database yet.
var ErrSchemaMissing = errors.New("kfn schema is missing: run `kfn migrate` against this database first")

// VersionError reports a database whose schema version differs from the one
// this binary was built for.
type VersionError struct {
	Database int // version found in the database
	Binary   int // newest version this binary knows
}

func (e *VersionError) Error() string {
	if e.Database > e.Binary {
		return fmt.Sprintf("database schema is version %d but this binary only knows up to version %d: upgrade this binary (it is older than the schema)", e.Database, e.Binary)
	}
	return fmt.Sprintf("database schema is version %d but this binary needs version %d: run `kfn migrate`", e.Database, e.Binary)
}

// Migrations returns the embedded migrations in version order.
func Migrations() []Migration {
	entries, err := fs.ReadDir(migrationFiles, "migrations")
	if err != nil {
		panic(fmt.Sprintf("read embedded migrations: %v", err))
	}
	var out []Migration
	for _, e := range entries {
		name := e.Name()
		num, _, ok := strings.Cut(name, "_")
		version, err := strconv.Atoi(num)
		if !ok || err != nil {
			panic(fmt.Sprintf("embedded migration %q is not named NNNN_name.sql", name))
		}
		body, err := migrationFiles.ReadFile(path.Join("migrations", name))
		if err != nil {
			panic(fmt.Sprintf("read embedded migration %s: %v", name, err))
		}
		out = append(out, Migration{Version: version, Name: strings.TrimSuffix(name, ".sql"), SQL: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out
}

// Latest is the schema version this binary was built for.
func Latest() int {
	m := Migrations()
	return m[len(m)-1].Version
}

// migrateLockKey serialises concurrent migrators (several workers starting at
// once) through a Postgres advisory lock.
const migrateLockKey = 0x6b666e /* "kfn" */

// Migrate applies every embedded migration newer than the database's version,
// each in its own transaction, and returns the versions it applied. It is
// safe to run concurrently from several processes.
func Migrate(ctx context.Context, pool *pgxpool.Pool) ([]int, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrate: connect: %w", err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", migrateLockKey); err != nil {
		return nil, fmt.Errorf("migrate: take migration lock: %w", err)
	}
	defer conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", migrateLockKey) //nolint:errcheck // released with the session anyway

	current, err := databaseVersion(ctx, conn.Conn())
	if err != nil && !errors.Is(err, ErrSchemaMissing) {
		return nil, err
	}
	if current > Latest() {
		return nil, &VersionError{Database: current, Binary: Latest()}
	}
	var applied []int
	for _, m := range Migrations() {
		if m.Version <= current {
			continue
		}
		err := pgx.BeginFunc(ctx, conn.Conn(), func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "INSERT INTO kfn.schema_migrations (version, name) VALUES ($1, $2)", m.Version, m.Name)
			return err
		})
		if err != nil {
			return applied, fmt.Errorf("migrate: apply %s: %w", m.Name, err)
		}
		applied = append(applied, m.Version)
	}
	return applied, nil
}

// Check returns nil when the database schema is exactly the version this
// binary needs, ErrSchemaMissing when kfn was never migrated there, and a
// *VersionError otherwise.
func Check(ctx context.Context, pool *pgxpool.Pool) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("check schema: connect to Postgres: %w", err)
	}
	defer conn.Release()
	v, err := databaseVersion(ctx, conn.Conn())
	if err != nil {
		return err
	}
	if v != Latest() {
		return &VersionError{Database: v, Binary: Latest()}
	}
	return nil
}

// Version returns the schema version recorded in the database.
func Version(ctx context.Context, pool *pgxpool.Pool) (int, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return 0, fmt.Errorf("read schema version: connect to Postgres: %w", err)
	}
	defer conn.Release()
	return databaseVersion(ctx, conn.Conn())
}

func databaseVersion(ctx context.Context, conn *pgx.Conn) (int, error) {
	var v *int
	err := conn.QueryRow(ctx, "SELECT max(version) FROM kfn.schema_migrations").Scan(&v)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000") { // undefined_table, invalid_schema_name
		return 0, ErrSchemaMissing
	}
	if err != nil {
		return 0, fmt.Errorf("read schema version: %w", err)
	}
	if v == nil {
		return 0, ErrSchemaMissing
	}
	return *v, nil
}
