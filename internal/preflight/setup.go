package preflight

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/observe"
	"github.com/kfn-dev/kfn/internal/settings"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// RunSetup runs the Setup of each function in fns that has one, each in a
// transaction of its own. A Setup may migrate large tables: it runs without
// the round-trip and statement limits of the record path.
func RunSetup(ctx context.Context, pool *pgxpool.Pool, fns []kfn.Function) error {
	for _, fn := range fns {
		if fn.Setup == nil {
			continue
		}
		setupCtx := observe.NoRoundTripLimit(ctx)
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

// SetupDenied explains a Setup the worker's role may not run (a role with
// DML rights only): the DDL is the migrator's, once, and the workers skip it.
func SetupDenied(err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" { // insufficient_privilege
		return err
	}
	return fmt.Errorf("%w: the role of --%s (%s) may not run the function's Setup DDL; "+
		"run the function binary's migrate mode (`<binary> %s`) once as the role that owns the schema, and start the workers with --%s (%s)",
		err, settings.DatabaseURL.Flag, settings.DatabaseURL.Env, MigrateCommand, settings.SkipSetup.Flag, settings.SkipSetup.Env)
}
