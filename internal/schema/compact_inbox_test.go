package schema_test

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestMigration12KeepsTheDedupOfEveryOldInboxRow writes inbox rows in the
// layout of schema 11 (keyed by consumer, topic and partition), among them
// the rows a bounded re-execution left at and above the high-water mark,
// migrates to the compact key, and replays those offsets: only the offsets
// the re-execution released are claimed, every old row still blocks its
// offset. Every row keeps its epoch, outcome and time; a worker role of
// the old installation (granted on kfn.inbox) keeps reading and claiming,
// and a role bound to one function sees that function's rows only. It
// migrates both ways: migration 0012 copying the rows itself, and after
// the online copy.
func TestMigration12KeepsTheDedupOfEveryOldInboxRow(t *testing.T) {
	t.Run("offline", func(t *testing.T) { testMigration12KeepsDedup(t, schema.MigrateOffline) })
	t.Run("online", func(t *testing.T) { testMigration12KeepsDedup(t, schema.Migrate) })
}

func testMigration12KeepsDedup(t *testing.T, migrate func(context.Context, *pgxpool.Pool) ([]int, error)) {
	t.Parallel()
	db := kfntest.PostgresEmpty(t)
	ctx := context.Background()
	if _, err := schema.MigrateTo(ctx, db.Pool, 11); err != nil {
		t.Fatal(err)
	}
	worker := newRole(t, db.Pool, "worker")
	quoted := pgx.Identifier{worker}.Sanitize()
	for _, sql := range []string{
		`GRANT USAGE ON SCHEMA kfn TO ` + quoted,
		`GRANT SELECT, INSERT, UPDATE, DELETE ON kfn.cursors, kfn.inbox, kfn.audit_log TO ` + quoted,
		`GRANT USAGE ON SEQUENCE kfn.audit_log_id_seq TO ` + quoted,
		`INSERT INTO kfn.function_roles (role_name, consumer) VALUES ('` + worker + `', '*')`,
		// a/t/0 was re-executed over [40, 60) under the old layout: the
		// cursor and its high-water mark went back to 40, the rows of
		// [40, 60) were released, and the rows of [60, 100) stay to keep
		// those records skipped; 70 was dead-lettered.
		`INSERT INTO kfn.cursors (consumer, topic, partition, next_offset, high_water, epoch, owner) VALUES
		   ('a', 't', 0, 40, 40, 1, 'w'), ('a', 't', 1, 10, 10, 1, 'w'), ('b', 't', 0, 5, 5, 1, 'w')`,
		`INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch, outcome, processed_at)
		 SELECT 'a', 't', 0, o, 1, CASE o WHEN 70 THEN 'dead_lettered' ELSE 'applied' END, now() - o * interval '1 minute'
		   FROM generate_series(0, 99) AS o WHERE o NOT BETWEEN 40 AND 59`,
		`INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch) SELECT 'a', 't', 1, o, 1 FROM generate_series(0, 9) AS o`,
		`INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch) SELECT 'b', 't', 0, o, 1 FROM generate_series(0, 4) AS o`,
		// A row whose cursor is gone keeps its lane too.
		`INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch) VALUES ('c', 't', 3, 7, 2)`,
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	const rowsSQL = `SELECT array_agg(format('%s/%s/%s@%s epoch %s %s %s', consumer, topic, partition, "offset", epoch, outcome, processed_at)
	                               ORDER BY consumer, topic, partition, "offset")`
	var before []string
	if err := db.Pool.QueryRow(ctx, rowsSQL+` FROM kfn.inbox`).Scan(&before); err != nil {
		t.Fatal(err)
	}

	if applied, err := migrate(ctx, db.Pool); err != nil || !slices.Contains(applied, 12) {
		t.Fatalf("Migrate = %v, %v; want 12 applied", applied, err)
	}
	var after []string
	if err := db.Pool.QueryRow(ctx, rowsSQL+` FROM kfn.inbox JOIN kfn.lanes ON id = lane`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(before, after) {
		t.Errorf("the inbox after migration 12 holds %d rows, before %d; first rows after %q, before %q", len(after), len(before), after[:3], before[:3])
	}

	// A new owner of a/t/0 resumes at 40 and reads [40, 100) again: the
	// records of [40, 60) are claimed, the others stay handled.
	asWorker := poolAs(t, db.URL, worker)
	a0 := inbox.Partition{Consumer: "a", Topic: "t", Partition: 0}
	cur, err := inbox.ClaimPartition(ctx, asWorker, a0, 2, "w2", 0)
	if err != nil || cur.NextOffset != 40 || cur.HighWater != 40 {
		t.Fatalf("claim a/t/0 as the old installation's worker role: %+v, %v; want the cursor at 40", cur, err)
	}
	replayed := make([]int64, 0, 60)
	for o := int64(40); o < 100; o++ {
		replayed = append(replayed, o)
	}
	fresh := claimInTx(t, asWorker, a0, 2, 40, 100, replayed)
	if want := replayed[:20]; !slices.Equal(fresh, want) {
		t.Errorf("replaying [40, 100) of a/t/0 after migration 12 claimed %v; want only [40, 60): an old row must block its offset", fresh)
	}
	var outcome string
	err = db.Pool.QueryRow(ctx, `SELECT outcome FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = 'a' AND partition = 0 AND "offset" = 70`).Scan(&outcome)
	if err != nil || outcome != "dead_lettered" {
		t.Errorf("offset 70 of a/t/0 is %q (%v) after the replay; want dead_lettered, as before", outcome, err)
	}
	// The same through Claim, for a partition whose lane the migration made.
	b0 := inbox.Partition{Consumer: "b", Topic: "t", Partition: 0}
	err = pgx.BeginFunc(ctx, asWorker, func(tx pgx.Tx) error {
		fresh, err := inbox.Claim(ctx, tx, b0, 2, inbox.Applied, []int64{3, 4, 5, 6})
		if err == nil && !slices.Equal(fresh, []int64{5, 6}) {
			t.Errorf("Claim of b/t/0 3..6 after migration 12 = %v; want [5 6]", fresh)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}

	// A role bound to function a sees a's rows only, and its lanes.
	fnA := newRole(t, db.Pool, "fn_a")
	if err := schema.ApplyGrants(ctx, db.Pool, fnA, "a", nil); err != nil {
		t.Fatal(err)
	}
	var rows, lanes int
	if err := poolAs(t, db.URL, fnA).QueryRow(ctx, `SELECT (SELECT count(*) FROM kfn.inbox), (SELECT count(*) FROM kfn.lanes)`).Scan(&rows, &lanes); err != nil || rows != 80+20+10 || lanes != 2 {
		t.Errorf("a role bound to function a sees %d inbox rows in %d lanes (%v); want 110 in 2", rows, lanes, err)
	}
}

// claimInTx fences p from `from` to `to` under token and claims offsets,
// in a transaction it commits, and returns the fresh offsets.
func claimInTx(t *testing.T, pool *pgxpool.Pool, p inbox.Partition, token, from, to int64, offsets []int64) []int64 {
	t.Helper()
	ctx := context.Background()
	var fresh []int64
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		result := inbox.QueueFenceAndClaim(b, p, token, from, to, offsets)
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return err
		}
		var err error
		fresh, err = result(ctx, tx)
		return err
	})
	if err != nil {
		t.Fatalf("fence and claim %s from %d to %d: %v", p, from, to, err)
	}
	return fresh
}
