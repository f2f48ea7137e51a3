package schema

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// AllFunctions is the consumer a role is bound to in kfn.function_roles to
// see and write the rows of every function: the operator's role, the
// relay's, and a worker role shared by every function of an installation.
const AllFunctions = "*"

// FunctionGrants are the statements that let role run function's workers
// and touch nothing else of kfn (migration 0011_function_roles): the
// rights on kfn's tables a worker's lanes use, and the row in
// kfn.function_roles that binds role to function, which row-level
// security then holds it to. tables are the function's own tables
// (schema-qualified or in public), granted DML; with none the statements
// end with a comment asking for them. The workers of a role so bound run
// without the outbox relay (--no-relay): the relay reads every function's
// rows, so it runs as `kfn relay` under a role bound to AllFunctions,
// which also gets DELETE on kfn.outbox and UPDATE on kfn.wal_outbox (the
// WAL slot reader's fence; reading the slot also needs REPLICATION).
//
// They are run, in one transaction, by the owner of kfn's tables (the
// migrator): only it may write kfn.function_roles. role must exist.
func FunctionGrants(role, function string, tables []string) []string {
	r := pgx.Identifier{role}.Sanitize()
	out := []string{
		"GRANT USAGE ON SCHEMA kfn TO " + r,
		"GRANT SELECT ON kfn.installation, kfn.schema_migrations TO " + r,
		// Row-level security limits each of these to the function's rows.
		"GRANT SELECT, INSERT, UPDATE, DELETE ON kfn.cursors, kfn.inbox, kfn.event_inbox, kfn.dead_letters, kfn.parked_keys, kfn.subject_lanes, kfn.key_lanes TO " + r,
		// Appended to only: the relay deletes outbox rows, and no worker
		// rewrites the audit log.
		"GRANT SELECT, INSERT ON kfn.outbox, kfn.audit_log TO " + r,
		// A worker adds its partitions' lanes, which key the inbox.
		"GRANT SELECT, INSERT ON kfn.lanes TO " + r,
		"GRANT USAGE ON SEQUENCE kfn.outbox_id_seq, kfn.dead_letters_id_seq, kfn.audit_log_id_seq TO " + r,
	}
	if function == AllFunctions { // it may run the relay: it reads and deletes every function's outbox rows, and reads the WAL outbox's slot (its fence and reports)
		out = append(out, "GRANT DELETE ON kfn.outbox TO "+r, "GRANT UPDATE ON kfn.wal_outbox TO "+r)
	}
	out = append(out,
		fmt.Sprintf("INSERT INTO kfn.function_roles (role_name, consumer) VALUES (%s, %s) ON CONFLICT DO NOTHING", literal(role), literal(function)))
	schemas := map[string]bool{}
	var dml []string
	for _, t := range tables {
		schema, name, ok := strings.Cut(t, ".")
		if !ok {
			schema, name = "public", t
		}
		if !schemas[schema] {
			schemas[schema] = true
			out = append(out, "GRANT USAGE ON SCHEMA "+pgx.Identifier{schema}.Sanitize()+" TO "+r)
		}
		dml = append(dml, pgx.Identifier{schema, name}.Sanitize())
	}
	if len(dml) > 0 {
		out = append(out, "GRANT SELECT, INSERT, UPDATE, DELETE ON "+strings.Join(dml, ", ")+" TO "+r)
		// The sequences of their serial and identity columns.
		lits := make([]string, len(dml))
		for i, t := range dml {
			lits[i] = literal(t)
		}
		out = append(out, fmt.Sprintf(`DO $grants$
DECLARE seq regclass;
BEGIN
    FOR seq IN SELECT d.objid::regclass FROM pg_depend d JOIN pg_class c ON c.oid = d.objid
                WHERE c.relkind = 'S' AND d.deptype IN ('a', 'i')
                  AND d.refobjid = ANY (ARRAY[%s]::regclass[])
    LOOP
        EXECUTE format('GRANT USAGE ON SEQUENCE %%s TO %%I', seq, %s);
    END LOOP;
END;
$grants$`, strings.Join(lits, ", "), literal(role)))
	}
	return out
}

// TablesTODO is the comment FunctionGrants' printout ends with when no
// table of the function is named: kfn cannot list the tables a function's
// Setup creates.
func TablesTODO(role, function string) string {
	r := pgx.Identifier{role}.Sanitize()
	return fmt.Sprintf(`-- The tables of %s: kfn cannot list what its Setup creates. For each of them
-- (and USAGE on the sequences of their serial or identity columns):
--   GRANT USAGE ON SCHEMA public TO %s;
--   GRANT SELECT, INSERT, UPDATE, DELETE ON public.<table> TO %s;`, function, r, r)
}

// ApplyGrants runs FunctionGrants in one transaction on conn.
func ApplyGrants(ctx context.Context, conn interface {
	Begin(context.Context) (pgx.Tx, error)
}, role, function string, tables []string) error {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit
	for _, stmt := range FunctionGrants(role, function, tables) {
		if _, err := tx.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("%s: %w", stmt, err)
		}
	}
	return tx.Commit(ctx)
}

// literal quotes s as an SQL string literal.
func literal(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}
