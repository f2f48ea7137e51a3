package preflight

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/settings"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// CheckRole refuses to start a worker whose database role cannot do its
// work, naming what to change: a role that lacks a right the lanes of fns
// (and, with relay, the outbox relay) need on kfn's tables, a role that
// row-level security binds to some functions only while it relays, or one
// not bound to one of fns.
func CheckRole(ctx context.Context, pool *pgxpool.Pool, fns []kfn.Function, relay bool) error {
	bound, err := readBindings(ctx, pool, fns)
	if err != nil {
		return err
	}
	if err := bound.relayError(relay); err != nil {
		return err
	}
	if err := checkPrivileges(ctx, pool, neededPrivileges(fns, relay)); err != nil {
		return err
	}
	return bound.unboundError()
}

// privilege is one right a worker's role needs on an object of kfn's
// schema: a table (SELECT, INSERT, …) or a sequence (USAGE).
type privilege struct {
	object, kind, right string // kind: "table" or "sequence"
}

// neededPrivileges are the rights on kfn's own tables that the lanes of
// fns use in every batch (the claim, the fenced cursor, the inbox, dead
// letters, the outbox and the claim's audit row) and, with relay, that the
// outbox relay uses. Without one of them every batch would fail and be
// retried as if Postgres were down; the function's own tables are not
// checked.
func neededPrivileges(fns []kfn.Function, relay bool) []privilege {
	ps := []privilege{
		{"kfn.cursors", "table", "SELECT"}, {"kfn.cursors", "table", "INSERT"}, {"kfn.cursors", "table", "UPDATE"},
		{"kfn.lanes", "table", "SELECT"}, {"kfn.lanes", "table", "INSERT"}, // a claim adds its partition's lane
		{"kfn.dead_letters", "table", "SELECT"}, {"kfn.dead_letters", "table", "INSERT"},
		{"kfn.dead_letters_id_seq", "sequence", "USAGE"},
		{"kfn.outbox", "table", "INSERT"}, {"kfn.outbox_id_seq", "sequence", "USAGE"},
		{"kfn.audit_log", "table", "INSERT"}, {"kfn.audit_log_id_seq", "sequence", "USAGE"},
	}
	inboxes := map[string]bool{}
	for _, fn := range fns {
		if fn.Subject != "" {
			inboxes["kfn.event_inbox"] = true
		} else {
			inboxes["kfn.inbox"] = true
		}
	}

	for _, table := range []string{"kfn.inbox", "kfn.event_inbox"} {
		if inboxes[table] {
			ps = append(ps, privilege{table, "table", "SELECT"}, privilege{table, "table", "INSERT"})
		}
	}
	if relay {
		ps = append(ps, privilege{"kfn.outbox", "table", "SELECT"}, privilege{"kfn.outbox", "table", "DELETE"})
	}
	return ps
}

const missingPrivilegesSQL = `
SELECT current_user::text, coalesce(array_agg(p.right_ || ' on ' || p.object ORDER BY p.n), '{}')
  FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS p(object, kind, right_, n)
 WHERE NOT CASE p.kind WHEN 'sequence' THEN has_sequence_privilege(p.object, p.right_)
                       ELSE has_table_privilege(p.object, p.right_) END`

// checkPrivileges refuses to start a worker whose Postgres role lacks one
// of the rights its lanes need on kfn's tables, naming each missing one.
func checkPrivileges(ctx context.Context, pool *pgxpool.Pool, needed []privilege) error {
	objects, kinds, rights := make([]string, len(needed)), make([]string, len(needed)), make([]string, len(needed))
	for i, p := range needed {
		objects[i], kinds[i], rights[i] = p.object, p.kind, p.right
	}
	var role string
	var missing []string
	if err := pool.QueryRow(ctx, missingPrivilegesSQL, objects, kinds, rights).Scan(&role, &missing); err != nil {
		return fmt.Errorf("check the privileges of the database role: %w", err)
	}
	if len(missing) == 0 {
		return nil
	}
	return ConfigErrorOf(settings.DatabaseURL, "the role %q lacks privileges a worker needs in kfn's schema (%s): grant the workers' role SELECT, INSERT, UPDATE and DELETE on kfn's tables and USAGE on its sequences (README, \"Running in production\")",
		role, strings.Join(missing, ", "))
}
