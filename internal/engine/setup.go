package engine

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/internal/settings"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// runSetup runs the Setup of each function in fns that has one, each in a
// transaction of its own. A Setup may migrate large tables: it runs without
// the round-trip and statement limits of the record path.
func runSetup(ctx context.Context, pool *pgxpool.Pool, fns []kfn.Function) error {
	for _, fn := range fns {
		if fn.Setup == nil {
			continue
		}
		setupCtx := noRoundTripLimit(ctx)
		err := pgx.BeginFunc(setupCtx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(setupCtx, `SET LOCAL statement_timeout = 0; SET LOCAL idle_in_transaction_session_timeout = 0`); err != nil {
				return err
			}
			// CREATE TABLE IF NOT EXISTS is not safe against itself: two
			// workers starting at once could both create the table, and one
			// would fail. The lock makes the other wait and find it.
			if _, err := tx.Exec(setupCtx, `SELECT pg_advisory_xact_lock(hashtext('kfn function setup: ' || $1))`, fn.Name); err != nil {
				return err
			}
			return fn.Setup(setupCtx, tx)
		})
		if err != nil {
			return fmt.Errorf("function %s: setup: %w", fn.Name, err)
		}
	}
	return nil
}

// MigrateCommand is the argument that puts a function binary in its migrate
// mode: `orders migrate --database-url …` applies kfn's schema migrations
// and the function's Setup, then exits.
const MigrateCommand = "migrate"

// setupDenied explains a Setup the worker's role may not run (a role with
// DML rights only): the DDL is the migrator's, once, and the workers skip it.
func setupDenied(err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" { // insufficient_privilege
		return err
	}
	return fmt.Errorf("%w: the role of --%s (%s) may not run the function's Setup DDL; "+
		"run the function binary's migrate mode (`<binary> %s`) once as the role that owns the schema, and start the workers with --%s (%s)",
		err, settings.DatabaseURL.Flag, settings.DatabaseURL.Env, MigrateCommand, settings.SkipSetup.Flag, settings.SkipSetup.Env)
}

// migrateMain is Main's migrate mode. It needs only --database-url: run it
// as the role that owns the schema (the migrator), once per deployment,
// and start the workers with --skip-setup under a role with DML rights only.
func migrateMain(fn kfn.Function, name string, args []string, stdout, stderr io.Writer) int {
	cmd := name + " " + MigrateCommand
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.SetOutput(stdout) // -h: the usage is what was asked for
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: %s %s --database-url URL\n\n"+
			"Applies kfn's schema migrations and the function's Setup, then exits; safe to run again.\n"+
			"Run it as the role that owns the schema, and the workers with --%s under a role with DML rights only.\n\n",
			name, MigrateCommand, settings.SkipSetup.Flag)
		settings.PrintDefaults(fs)
	}
	b := settings.NewBinder(fs)
	var dbURL string
	settings.DatabaseURL.Bind(b, &dbURL)
	if code, ok := parseArgs(fs, args, cmd, stderr); !ok {
		return code
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "%s: unexpected argument %q (see %s -h)\n", cmd, fs.Arg(0), cmd)
		return 2
	}
	if errs := b.Errors(); len(errs) > 0 {
		fmt.Fprintf(stderr, "%s: %s (see %s -h)\n", cmd, settingsLine(errs), cmd)
		return 2
	}
	if dbURL == "" {
		fmt.Fprintf(stderr, "%s: --%s is required (or set %s) (see %s -h)\n", cmd, settings.DatabaseURL.Flag, settings.DatabaseURL.Env, cmd)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	pool, err := connect.Postgres(ctx, dbURL, name+" "+MigrateCommand, nil)
	var urlErr *connect.URLError
	if errors.As(err, &urlErr) {
		fmt.Fprintf(stderr, "%s %s: %v\n", name, MigrateCommand, urlErr)
		return 2
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s %s: %v\n", name, MigrateCommand, err)
		return 1
	}
	defer pool.Close()
	applied, err := schema.Migrate(ctx, pool)
	if err != nil {
		fmt.Fprintf(stderr, "%s %s: %v\n", name, MigrateCommand, err)
		return 1
	}
	fmt.Fprintf(stdout, "kfn %s\n", schema.Outcome(applied))
	if err := runSetup(ctx, pool, []kfn.Function{fn}); err != nil {
		fmt.Fprintf(stderr, "%s %s: %v\n", name, MigrateCommand, err)
		return 1
	}
	if fn.Setup == nil {
		fmt.Fprintf(stdout, "function %s has no Setup\n", fn.Name)
	} else {
		fmt.Fprintf(stdout, "function %s: Setup applied\n", fn.Name)
	}
	return 0
}
