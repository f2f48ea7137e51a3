package kfntest

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/devstack"
	"github.com/kfn-dev/kfn/internal/schema"
)

// EnvDatabaseURL names a Postgres server for the tests; see the package doc.
const EnvDatabaseURL = "KFN_TEST_DATABASE_URL"

// PG is a fresh database for one test.
type PG struct {
	// Pool is connected to the test's database (at most 10 connections).
	Pool *pgxpool.Pool
	// URL connects to the test's database, for worker processes and CLIs.
	URL string
	// Database is the database's name.
	Database string
}

// pgMaxConns keeps each test's pool modest: a throwaway cluster allows 300
// connections and many tests run in parallel.
const pgMaxConns = 10

// Postgres creates a fresh database on the shared server, migrates it with
// schema.Migrate and drops it (WITH (FORCE)) when the test ends.
func Postgres(t testing.TB) *PG {
	t.Helper()
	return newDatabase(t, true)
}

// PostgresEmpty is Postgres without the migration, for tests of the migrator
// and of the start-up schema check.
func PostgresEmpty(t testing.TB) *PG {
	t.Helper()
	return newDatabase(t, false)
}

func newDatabase(t testing.TB, migrate bool) *PG {
	t.Helper()
	srv := pgServer(t)
	pg, err := createDatabase(srv, databaseName(t), migrate)
	if pg != nil {
		t.Cleanup(func() {
			if err := dropDatabase(srv, pg); err != nil {
				t.Errorf("kfntest: %v", err)
			}
		})
	}
	if err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	return pg
}

// SharedPostgres returns a database for code that runs without a test of
// its own, such as a package's runnable examples: created and migrated on
// the first call, shared by every later call, and dropped when Main
// finishes (it needs Main, like every shared service). A caller keeps its
// writes apart from the others' by rolling back the transaction it makes
// them in.
func SharedPostgres() (*PG, error) {
	sharedDB.Do(func() {
		if os.Getenv(EnvDatabaseURL) == "" && !mainRunning.Load() {
			sharedDB.err = fmt.Errorf("kfntest: SharedPostgres needs the package's TestMain to call kfntest.Main")
			return
		}
		pgOnce.Do(func() { pgOnce.srv, pgOnce.err = startPGServer() })
		if pgOnce.err != nil {
			sharedDB.err = fmt.Errorf("kfntest: %w", pgOnce.err)
			return
		}
		name := fmt.Sprintf("kfntest_shared_%s%d", strings.ToLower(strings.ReplaceAll(runID, "-", "_")), nameSeq.Add(1))
		sharedDB.pg, sharedDB.err = createDatabase(pgOnce.srv, name, true)
		if sharedDB.pg != nil {
			onShutdown(func() {
				if err := dropDatabase(pgOnce.srv, sharedDB.pg); err != nil {
					announce("%v", err)
				}
			})
		}
	})
	return sharedDB.pg, sharedDB.err
}

var sharedDB struct {
	sync.Once
	pg  *PG
	err error
}

// createDatabase creates database name on srv, connects a pool to it and
// migrates it if asked. A *PG is returned whenever the database was
// created, so that it is dropped even when connecting or migrating failed.
func createDatabase(srv *sharedPG, name string, migrate bool) (*PG, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := srv.admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return nil, fmt.Errorf("create database %s on %s: %w", name, srv.display, err)
	}
	dbURL := *srv.url
	dbURL.Path = "/" + name
	pg := &PG{URL: dbURL.String(), Database: name}
	cfg, err := pgxpool.ParseConfig(pg.URL)
	if err != nil {
		return pg, fmt.Errorf("parse database URL: %w", err)
	}
	cfg.MaxConns = pgMaxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return pg, fmt.Errorf("connect to database %s: %w", name, err)
	}
	pg.Pool = pool
	if migrate {
		if _, err := schema.Migrate(ctx, pool); err != nil {
			return pg, fmt.Errorf("migrate database %s: %w", name, err)
		}
	}
	return pg, nil
}

// dropDatabase closes pg's pool and drops its database.
func dropDatabase(srv *sharedPG, pg *PG) error {
	if pg.Pool != nil {
		pg.Pool.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// A logical replication slot (the WAL outbox's) keeps its database from
	// being dropped: end its reader and drop it first.
	if _, err := srv.admin.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL`, pg.Database); err != nil {
		return fmt.Errorf("end the replication of database %s: %w", pg.Database, err)
	}
	if err := dropSlots(ctx, srv.admin, pg.Database); err != nil {
		return err
	}
	if _, err := srv.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{pg.Database}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", pg.Database, err)
	}
	return nil
}

// databaseName is a unique, lower-case Postgres identifier of at most 63 bytes.
func databaseName(t testing.TB) string {
	n := strings.ToLower(strings.ReplaceAll(Name(t, ""), "-", "_"))
	// Postgres cuts an identifier at 63 bytes: the test's name gives way,
	// not the unique suffix (a test of a long name that makes two
	// databases got the same name twice).
	if room := 63 - len("kfntest_"); len(n) > room {
		cut := strings.LastIndex(n, "_")
		n = n[:room-(len(n)-cut)] + n[cut:]
	}
	return "kfntest_" + n
}

// sharedPG is the server every test database is created on.
type sharedPG struct {
	url     *url.URL
	display string // host:port, without credentials
	version string // server_version
	admin   *pgxpool.Pool
}

var pgOnce struct {
	sync.Once
	srv *sharedPG
	err error
}

func pgServer(t testing.TB) *sharedPG {
	t.Helper()
	if os.Getenv(EnvDatabaseURL) == "" {
		requireMain(t, "kfntest.Postgres (throwaway PostgreSQL cluster)")
	}
	pgOnce.Do(func() { pgOnce.srv, pgOnce.err = startPGServer() })
	if pgOnce.err != nil {
		t.Fatalf("kfntest: %v", pgOnce.err)
	}
	return pgOnce.srv
}

func startPGServer() (*sharedPG, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	raw := os.Getenv(EnvDatabaseURL)
	fromEnv := raw != ""
	if !fromEnv {
		start := time.Now()
		cluster, err := devstack.StartPostgres(ctx, devstack.PostgresOptions{Logger: logger})
		if err != nil {
			return nil, fmt.Errorf("start a throwaway Postgres cluster (or set %s to a server where tests may CREATE DATABASE): %w", EnvDatabaseURL, err)
		}
		onShutdown(func() {
			if err := cluster.Stop(); err != nil {
				announce("stop throwaway Postgres: %v", err)
			}
		})
		logger.Debug("throwaway postgres started", "url", cluster.URL, "took", time.Since(start))
		raw = cluster.URL
	}
	srv, err := connectServer(ctx, raw)
	if err != nil {
		if fromEnv {
			err = fmt.Errorf("%s: %w", EnvDatabaseURL, err)
		}
		return nil, err
	}
	onShutdown(srv.admin.Close)
	if fromEnv {
		announce("Postgres from %s: %s, server version %s", EnvDatabaseURL, srv.display, srv.version)
	}
	return srv, nil
}

// connectServer connects an admin pool to the server raw names; the caller
// closes it.
func connectServer(ctx context.Context, raw string) (*sharedPG, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return nil, fmt.Errorf("the server must be a URL like postgres://user:pass@host:5432/postgres?sslmode=disable, got %q", redact(raw))
	}
	cfg, err := pgxpool.ParseConfig(raw)
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", redact(raw), err)
	}
	cfg.MaxConns = 4
	admin, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", redact(raw), err)
	}
	srv := &sharedPG{url: u, display: u.Host, admin: admin}
	if err := admin.QueryRow(ctx, "SHOW server_version").Scan(&srv.version); err != nil {
		admin.Close()
		return nil, fmt.Errorf("connect to Postgres at %s: %w", redact(raw), err)
	}
	return srv, nil
}

// redact hides a password in a URL for error messages and logs.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparseable URL)"
	}
	return u.Redacted()
}

// dropSlots drops the replication slots of database, waiting (briefly) for
// the walsenders just terminated to let go of them.
func dropSlots(ctx context.Context, admin *pgxpool.Pool, database string) error {
	for {
		_, err := admin.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1`, database)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil || !strings.Contains(err.Error(), "is active") {
			return fmt.Errorf("drop the replication slots of database %s: %w", database, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
