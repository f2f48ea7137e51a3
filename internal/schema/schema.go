// Package schema owns kfn's Postgres schema: the numbered SQL migrations
// embedded in every kfn binary, what each of them breaks for workers built
// for an older schema (its `-- kfn:additive` or `-- kfn:breaks-before N`
// marker, recorded in the database when it is applied), the migrator that
// applies them, and the start-up check that lets a worker run against its
// own schema or a newer compatible one, and refuses any other.
package schema

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// testMigrations holds migrations that exist only in builds with the
// kfn_upgrade_test tag (testdata/upgrade, see upgrade_test_migrations.go):
// the rolling-upgrade test applies them after the real ones. nil otherwise.
var testMigrations fs.FS

// maxVersion caps the embedded migrations at a version, to build a binary
// as the release built for that schema was:
//
//	go build -ldflags "-X github.com/kfn-dev/kfn/internal/schema.maxVersion=7" …
//
// The rolling-upgrade test runs such "older" workers. Empty: every
// embedded migration.
var maxVersion string

// Migration is one numbered SQL file.
type Migration struct {
	Version int
	Name    string
	SQL     string
	// BreaksBefore is what the file's first line declares: `-- kfn:additive`
	// (0: workers built for an older schema keep working once it is
	// applied) or `-- kfn:breaks-before N` (workers built for a schema
	// older than N stop working; N is at most Version).
	BreaksBefore int
}

// ErrSchemaMissing means kfn's tables do not exist in the database yet.
var ErrSchemaMissing = errors.New("kfn schema is missing: run `kfn migrate` against this database first")

// VersionError reports a database whose schema this binary cannot run
// against: older than the binary's (not migrated yet), or newer and not
// compatible with it.
type VersionError struct {
	Database int // version found in the database
	Binary   int // newest version this binary knows
	// For a newer database that records why this binary cannot run on it:
	// the first applied migration that breaks it, and the newest schema
	// version this binary runs against (the one before that migration).
	Breaking       string
	BreaksBefore   int
	CompatibleUpTo int
}

func (e *VersionError) Error() string {
	switch {
	case e.Database < e.Binary:
		return fmt.Sprintf("database schema is version %d but this binary needs version %d: run `kfn migrate`", e.Database, e.Binary)
	case e.Breaking != "":
		return fmt.Sprintf("database schema is version %d, but this binary is built for schema version %d and runs against versions %d to %d only: migration %s breaks workers built for a schema older than version %d; upgrade this binary to the release built for schema version %d (see Upgrades in kfn's README)",
			e.Database, e.Binary, e.Binary, e.CompatibleUpTo, e.Breaking, e.BreaksBefore, e.Database)
	default:
		return fmt.Sprintf("database schema is version %d but this binary only knows up to version %d: upgrade this binary (it is older than the schema)", e.Database, e.Binary)
	}
}

// Migrations returns the embedded migrations in version order.
func Migrations() []Migration { return slices.Clone(embedded()) }

var embedded = sync.OnceValue(func() []Migration {
	out := readMigrations(migrationFiles, "migrations")
	if testMigrations != nil {
		out = append(out, readMigrations(testMigrations, "testdata/upgrade")...)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	if maxVersion == "" {
		return out
	}
	capAt, err := strconv.Atoi(maxVersion)
	i := slices.IndexFunc(out, func(m Migration) bool { return m.Version == capAt })
	if err != nil || i < 0 {
		panic(fmt.Sprintf("schema.maxVersion %q (set with -ldflags -X) is not the version of an embedded migration", maxVersion))
	}
	return out[:i+1]
})

func readMigrations(files fs.FS, dir string) []Migration {
	entries, err := fs.ReadDir(files, dir)
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
		body, err := fs.ReadFile(files, path.Join(dir, name))
		if err != nil {
			panic(fmt.Sprintf("read embedded migration %s: %v", name, err))
		}
		m := Migration{Version: version, Name: strings.TrimSuffix(name, ".sql"), SQL: string(body)}
		if m.BreaksBefore, err = compatibility(m); err != nil {
			panic(err.Error())
		}
		out = append(out, m)
	}
	return out
}

// compatibility reads the marker on a migration's first line.
func compatibility(m Migration) (int, error) {
	first, _, _ := strings.Cut(m.SQL, "\n")
	first = strings.TrimSpace(first)
	if first == "-- kfn:additive" {
		return 0, nil
	}
	if n, ok := strings.CutPrefix(first, "-- kfn:breaks-before "); ok {
		if v, err := strconv.Atoi(n); err == nil && v >= 1 && v <= m.Version {
			return v, nil
		}
	}
	return 0, fmt.Errorf("migration %s must start with `-- kfn:additive` or `-- kfn:breaks-before N` (N at most %d: workers built for a schema older than N stop working once it is applied), not %q",
		m.Name, m.Version, first)
}

// Latest is the schema version this binary was built for.
func Latest() int {
	m := embedded()
	return m[len(m)-1].Version
}

// OldestCompatible is the oldest schema version a worker may be built for
// and still run against a database at this binary's version: every
// migration after it is additive or breaks only workers older than it.
func OldestCompatible() int {
	ms := embedded()
	oldest, breaks := ms[len(ms)-1].Version, 0
	for i := len(ms) - 1; i > 0; i-- {
		breaks = max(breaks, ms[i].BreaksBefore)
		if breaks > ms[i-1].Version {
			break
		}
		oldest = ms[i-1].Version
	}
	return oldest
}

// Outcome says what Migrate did, for a migrator's output: the migrations
// it applied (none: the schema was up to date), the schema version, and
// the oldest schema version a worker may be built for to run against it.
func Outcome(applied []int) string {
	if len(applied) == 0 {
		return fmt.Sprintf("schema is up to date at version %d", Latest())
	}
	return fmt.Sprintf("applied migrations %v; schema is at version %d; workers built for schema version %d or later run against it",
		applied, Latest(), OldestCompatible())
}

// compatColumn is the version of the migration that added
// kfn.schema_migrations.breaks_before: from it on, the migrator records
// what every applied migration breaks.
const compatColumn = 8

// migrateLockKey serialises concurrent migrators (several workers starting at
// once) through a Postgres advisory lock.
const migrateLockKey = 0x6b666e /* "kfn" */

// Migrate applies every embedded migration newer than the database's version,
// each in its own transaction, and returns the versions it applied. It is
// safe to run concurrently from several processes. On an installation at
// schema 11 or older it copies the inbox for migration 0012 first, while
// the workers run (compact_inbox.go).
func Migrate(ctx context.Context, pool *pgxpool.Pool) ([]int, error) {
	return migrateTo(ctx, pool, Latest(), migrateOptions{})
}

// MigrateReporting is Migrate, telling progress about the steps it takes
// outside a migration's transaction: the online copy of the inbox for
// migration 0012, which can take minutes, and the swap that ends it.
func MigrateReporting(ctx context.Context, pool *pgxpool.Pool, progress func(Progress)) ([]int, error) {
	return migrateTo(ctx, pool, Latest(), migrateOptions{progress: progress})
}

// migrateOptions are what a caller of migrateTo may change.
type migrateOptions struct {
	progress func(Progress)
	// offline applies migration 0012 without copying the inbox first, as
	// on a database with no schema yet (tests of that path).
	offline bool
	// backfillRows is the rows per transaction of the online copy; 0 is
	// the package's backfillRows.
	backfillRows int
	// lockWait is how long a statement of the online copy waits for a
	// lock at a time; 0 is the package's lockWait.
	lockWait time.Duration
}

func (o migrateOptions) report(p Progress) {
	if o.progress != nil {
		o.progress(p)
	}
}

func (o migrateOptions) lockTimeout() time.Duration {
	if o.lockWait > 0 {
		return o.lockWait
	}
	return lockWait
}

func (o migrateOptions) batchRows() int {
	if o.backfillRows > 0 {
		return o.backfillRows
	}
	return backfillRows
}

// migrateTo is Migrate up to version target only.
func migrateTo(ctx context.Context, pool *pgxpool.Pool, target int, o migrateOptions) ([]int, error) {
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
	var applied, versions, breaks []int
	for _, m := range embedded() {
		versions, breaks = append(versions, m.Version), append(breaks, m.BreaksBefore)
		if m.Version <= current || m.Version > target {
			continue
		}
		apply := func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, "INSERT INTO kfn.schema_migrations (version, name) VALUES ($1, $2)", m.Version, m.Name); err != nil {
				return err
			}
			if m.Version < compatColumn {
				return nil
			}
			// Every applied migration's marker, the earlier ones too (they
			// were applied before the column existed); 0 is stored as NULL.
			_, err := tx.Exec(ctx, `UPDATE kfn.schema_migrations s SET breaks_before = nullif(c.breaks, 0)
			                          FROM unnest($1::integer[], $2::integer[]) AS c(version, breaks)
			                         WHERE s.version = c.version`, versions, breaks)
			return err
		}
		// An installation migrated before may have workers running: they
		// keep running while the inbox is copied, and stand still for the
		// swap only.
		if m.Version == compactInboxVersion && current > 0 && !o.offline {
			if err := prepareCompactInbox(ctx, conn.Conn(), m, o); err != nil {
				return applied, fmt.Errorf("migrate: prepare %s online: %w", m.Name, err)
			}
			o.report(Progress{Migration: m.Name, Step: StepSwapping})
			var took time.Duration
			if took, err = lockingTx(ctx, conn.Conn(), m, o, apply); err == nil {
				o.report(Progress{Migration: m.Name, Step: StepSwapped, Elapsed: took})
			}
		} else {
			err = pgx.BeginFunc(ctx, conn.Conn(), apply)
		}
		if err != nil {
			return applied, fmt.Errorf("migrate: apply %s: %w", m.Name, err)
		}
		applied = append(applied, m.Version)
	}
	return applied, nil
}

// Check returns nil when this binary can run against the database's
// schema: its own version, or a newer one whose migrations after its own
// are all additive or break only workers older than it (rolling
// upgrades). It returns ErrSchemaMissing when kfn was never migrated there,
// and a *VersionError otherwise.
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
	binary := Latest()
	switch {
	case v == binary:
		return nil
	case v < binary:
		return &VersionError{Database: v, Binary: binary}
	}
	// A newer schema: the database records what each migration breaks.
	var breaking struct {
		name         string
		version      int
		breaksBefore int
	}
	err = conn.QueryRow(ctx, `SELECT name, version, breaks_before FROM kfn.schema_migrations
	                           WHERE version > $1 AND breaks_before > $1 ORDER BY version LIMIT 1`, binary).
		Scan(&breaking.name, &breaking.version, &breaking.breaksBefore)
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil
	case errors.As(err, &pgErr) && pgErr.Code == "42703": // undefined_column: migrated before compatibility was recorded
		return &VersionError{Database: v, Binary: binary}
	case err != nil:
		return fmt.Errorf("check schema: read what the migrations after version %d break: %w", binary, err)
	}
	return &VersionError{Database: v, Binary: binary, Breaking: breaking.name, BreaksBefore: breaking.breaksBefore, CompatibleUpTo: breaking.version - 1}
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
