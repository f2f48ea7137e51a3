package preflight

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/settings"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// bindingsSQL says, for the worker's role, whether row-level security
// applies to it on kfn's tables (not a superuser, not BYPASSRLS, not the
// tables' owner), which of the names it is not bound to in
// kfn.function_roles (migration 0011_function_roles), and whether it is
// bound to every function.
const bindingsSQL = `
SELECT current_user::text,
       NOT (r.rolsuper OR r.rolbypassrls OR c.relowner = r.oid),
       coalesce((SELECT array_agg(n ORDER BY n) FROM unnest($1::text[]) AS n
                  WHERE NOT ((SELECT kfn.bound_consumers()) && ARRAY[n, '*'])), '{}'),
       (SELECT kfn.bound_consumers()) && ARRAY['*']
  FROM pg_roles r, pg_class c
 WHERE r.rolname = current_user AND c.oid = 'kfn.cursors'::regclass`

// bindings is what row-level security holds the worker's role to.
type bindings struct {
	role          string
	restricted    bool     // row-level security applies to the role
	unbound       []string // the worker's functions the role is not bound to
	everyFunction bool     // the role is bound to every function ('*')
}

// readBindings reads the bindings of the worker's role for fns.
func readBindings(ctx context.Context, pool *pgxpool.Pool, fns []kfn.Function) (bindings, error) {
	names := make([]string, len(fns))
	for i, fn := range fns {
		names[i] = fn.Name
	}
	var b bindings
	err := pool.QueryRow(ctx, bindingsSQL, names).Scan(&b.role, &b.restricted, &b.unbound, &b.everyFunction)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" { // insufficient_privilege: checkPrivileges says which
		return bindings{}, nil
	}
	if err != nil {
		return b, fmt.Errorf("check the database role's bindings to functions: %w", err)
	}
	return b, nil
}

// relayError refuses to run the outbox relay under a role bound to some
// functions only: the relay must read every function's outbox rows, and
// such a role sees its own functions' rows only.
func (b bindings) relayError(relay bool) error {
	if !relay || !b.restricted || b.everyFunction || len(b.unbound) > 0 {
		return nil
	}
	return ConfigErrorOf(settings.DatabaseURL, "the role %q sees only its own functions' rows, but the outbox relay must read every function's outbox: start the workers with --%s (%s) and run kfn relay as a role bound to every function (docs/production/postgres.md, \"One role per function\")",
		b.role, settings.NoRelay.Flag, settings.NoRelay.Env)
}

// unboundError refuses to start a worker whose role is not bound to one
// of its functions: it would see none of the function's cursors and have
// every write refused, batch after batch, as if Postgres were failing.
func (b bindings) unboundError() error {
	if !b.restricted || len(b.unbound) == 0 {
		return nil
	}
	return ConfigErrorOf(settings.DatabaseURL, "the role %q is not bound to function %s in kfn.function_roles, so row-level security hides its rows from it: bind it as the migrator with `kfn migrate grants --apply --function NAME --role %s` (docs/production/postgres.md, \"One role per function\")",
		b.role, strings.Join(b.unbound, ", "), b.role)
}
