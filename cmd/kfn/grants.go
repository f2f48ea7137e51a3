package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/internal/settings"
)

var migrateCommands = map[string]command{
	"grants": {"print (or apply) the grants and the binding that give one function a Postgres role of its own", runMigrateGrants},
}

// runMigrateGrants is kfn migrate grants: the statements that let a role
// run one function's workers and touch only that function's rows of kfn's
// tables (schema.FunctionGrants), printed, or applied with --apply.
func runMigrateGrants(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("migrate grants", help{
		usage: []string{"kfn migrate grants --function NAME --role ROLE [--tables T[,T…]] [--apply --database-url URL]"},
		text: `
Prints the SQL that gives one function's workers a Postgres role of their
own: the rights on kfn's tables its workers use, DML on the function's own
tables (--tables), and the row of kfn.function_roles that binds the role to
the function. Row-level security (schema version 11) then holds the role to
that function's rows: its cursors, inbox, dead letters, parked keys, audit
rows and outbox rows. kfn cannot list the tables a function's Setup
creates: without --tables the output ends with the GRANT lines to complete.

With --apply it runs them, in one transaction, as the role of
--database-url, which must own kfn's tables (the migrator): only the owner
may bind a role. The role must exist (CREATE ROLE … LOGIN). Run the
function's workers as it with --no-relay, and kfn relay as a role bound
to every function (--function '*'), since the relay reads every function's
outbox rows.`,
		examples: `
kfn migrate grants --function orders --role kfn_fn_orders --tables orders
kfn migrate grants --function orders --role kfn_fn_orders --tables orders --apply --database-url postgres://kfn_migrator@db:5432/kfn`,
	}, stderr)
	function := fs.String("function", "", "the function's name (its consumer in kfn's tables), or '*' for every function")
	role := fs.String("role", "", "the Postgres role its workers connect as")
	tables := fs.String("tables", "", "the function's own tables, comma separated (schema.table, or public's)")
	apply := fs.Bool("apply", false, "run the statements against --database-url instead of printing them")
	dbURL := bind(fs, settings.DatabaseURL)
	if err := parse(fs, args); err != nil {
		return err
	}
	switch {
	case *function == "":
		return &usageError{msg: "missing --function: the function whose rows the role may touch (or '*' for every function)"}
	case *role == "":
		return &usageError{msg: "missing --role: the Postgres role the function's workers connect as"}
	}
	var names []string
	for _, t := range strings.Split(*tables, ",") {
		if t = strings.TrimSpace(t); t != "" {
			names = append(names, t)
		}
	}
	if !*apply {
		for _, stmt := range schema.FunctionGrants(*role, *function, names) {
			fmt.Fprintln(stdout, stmt+";")
		}
		if len(names) == 0 && *function != schema.AllFunctions {
			fmt.Fprintln(stdout, schema.TablesTODO(*role, *function))
		}
		return nil
	}
	pool, err := openDatabase(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := schema.Check(ctx, pool); err != nil {
		return err
	}
	if err := schema.ApplyGrants(ctx, pool, *role, *function, names); err != nil {
		if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "42501" { // insufficient_privilege
			return fmt.Errorf("%w: run kfn migrate grants --apply as the role that owns kfn's tables (the migrator)", err)
		}
		return err
	}
	fmt.Fprintf(stdout, "role %s may now run function %s: it touches that function's rows of kfn's tables only", *role, *function)
	if len(names) > 0 {
		fmt.Fprintf(stdout, ", and %s", strings.Join(names, ", "))
	}
	fmt.Fprintln(stdout)
	return nil
}
