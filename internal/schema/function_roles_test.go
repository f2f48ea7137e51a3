package schema_test

import (
	"context"
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestFunctionRolesKeepExistingRolesAndHoldNewOnes migrates a database at
// version 10, where a role already reads and writes kfn's tables (a
// running installation's kfn_worker), to version 11: that role still sees
// and moves every function's cursor (a rolling upgrade), while a role
// bound to one function with schema.FunctionGrants sees that function's
// rows only, and its fenced cursor update still reads the primary key.
func TestFunctionRolesKeepExistingRolesAndHoldNewOnes(t *testing.T) {
	db := kfntest.PostgresEmpty(t)
	ctx := context.Background()
	if _, err := schema.MigrateTo(ctx, db.Pool, 10); err != nil {
		t.Fatal(err)
	}
	shared, fnA := newRole(t, db.Pool, "shared"), newRole(t, db.Pool, "fn_a")
	for _, sql := range []string{
		`GRANT USAGE ON SCHEMA kfn TO ` + pgx.Identifier{shared}.Sanitize(),
		`GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA kfn TO ` + pgx.Identifier{shared}.Sanitize(),
		`INSERT INTO kfn.cursors (consumer, topic, partition, next_offset, high_water, epoch, owner)
		 SELECT c, 't', p, 0, 0, 1, 'w' FROM unnest(ARRAY['a', 'b']) AS c, generate_series(0, 3) AS p`,
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	if _, err := schema.Migrate(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	if err := schema.ApplyGrants(ctx, db.Pool, fnA, "a", nil); err != nil {
		t.Fatal(err)
	}

	const advance = `UPDATE kfn.cursors SET next_offset = 10, high_water = greatest(high_water, 10)
	                  WHERE consumer = $1 AND topic = 't' AND partition = 0 AND epoch = 1 AND next_offset = 0`
	for _, c := range []struct {
		role            string
		visible, movesB int64
	}{{shared, 8, 1}, {fnA, 4, 0}} {
		pool := poolAs(t, db.URL, c.role)
		var visible int64
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM kfn.cursors`).Scan(&visible); err != nil || visible != c.visible {
			t.Errorf("%s sees %d cursors (%v), want %d", c.role, visible, err, c.visible)
		}
		tag, err := pool.Exec(ctx, advance, "b")
		if err != nil || tag.RowsAffected() != c.movesB {
			t.Errorf("%s moves %d of b's cursors (%v), want %d", c.role, tag.RowsAffected(), err, c.movesB)
		}
		tag, err = pool.Exec(ctx, advance, "a")
		if err != nil || tag.RowsAffected() != 1 {
			t.Errorf("%s moves %d of a's cursors (%v), want 1", c.role, tag.RowsAffected(), err)
		}
		if _, err := pool.Exec(ctx, `UPDATE kfn.cursors SET next_offset = 0, high_water = 0 WHERE consumer = 'a'`); err != nil {
			t.Fatal(err)
		}
	}

	// The policy reads the binding once per statement and leaves the
	// fenced update on the primary key.
	var plan strings.Builder
	rows, err := poolAs(t, db.URL, fnA).Query(ctx, `EXPLAIN (COSTS OFF) `+strings.Replace(advance, "$1", "'a'", 1))
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		plan.WriteString(line + "\n")
	}
	if !strings.Contains(plan.String(), "Index Scan using cursors_pkey") || !strings.Contains(plan.String(), "InitPlan") {
		t.Errorf("the fenced cursor update under a function's role:\n%s\nwant an index scan of cursors_pkey and the binding read once (InitPlan)", plan.String())
	}
}

// newRole creates a login role of the test's own (roles belong to the
// cluster, which the tests share) and drops it when the test ends.
func newRole(t *testing.T, admin *pgxpool.Pool, prefix string) string {
	t.Helper()
	role := strings.ToLower(strings.ReplaceAll(kfntest.Name(t, prefix), "-", "_"))
	quoted := pgx.Identifier{role}.Sanitize()
	if _, err := admin.Exec(context.Background(), `CREATE ROLE `+quoted+` LOGIN PASSWORD 'kfn-test'`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, sql := range []string{`DROP OWNED BY ` + quoted, `DROP ROLE ` + quoted} {
			if _, err := admin.Exec(context.Background(), sql); err != nil {
				t.Errorf("%s: %v", sql, err)
			}
		}
	})
	return role
}

// poolAs connects to the database of dbURL as role.
func poolAs(t *testing.T, dbURL, role string) *pgxpool.Pool {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(role, "kfn-test")
	pool, err := pgxpool.New(context.Background(), u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}
