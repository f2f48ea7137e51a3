package schema_test

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// The migrations that add to dead letters (6: retry, 7: parked keys) run on
// a database holding dead letters written at the version before: the
// letters keep every byte, and the new feature works with them.
func TestMigrationsKeepExistingDeadLetters(t *testing.T) {
	part := inbox.Partition{Consumer: "fn", Topic: "orders", Partition: 0}
	cases := []struct {
		name    string
		version int // the migration under test; the database starts at the one before
		// before runs at the old version, after the letters are written.
		before func(t *testing.T, db *kfntest.PG)
		// after checks the new feature on the migrated letters.
		after func(t *testing.T, db *kfntest.PG, dead []inbox.DeadLetter)
	}{
		{name: "6 adds dead letter retry", version: 6,
			after: func(t *testing.T, db *kfntest.PG, _ []inbox.DeadLetter) {
				ctx := context.Background()
				var pending int
				if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.dead_letters WHERE retry_requested_at IS NOT NULL OR last_retry_at IS NOT NULL`).Scan(&pending); err != nil || pending != 0 {
					t.Errorf("%d migrated letters with retry state (%v), want none", pending, err)
				}
				var marks inbox.RetryMarks
				err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) (err error) {
					marks, err = inbox.MarkForRetry(ctx, tx, inbox.RetryRequest{
						RetrySelection: inbox.RetrySelection{Function: "fn", Partition: -1}, Actor: "ops", Reason: "after the upgrade",
					})
					return err
				})
				if err != nil || len(marks.Marked) != 2 || len(marks.Refused) != 0 {
					t.Fatalf("marking the migrated letters = %+v, %v; want both marked", marks, err)
				}
				lanes, err := inbox.PendingRetryLanes(ctx, db.Pool, []string{"fn"})
				if err != nil || !slices.Equal(lanes, []inbox.Partition{part}) {
					t.Errorf("lanes with pending retries = %v, %v; want %v", lanes, err, part)
				}
			}},
		{name: "7 adds parked keys", version: 7,
			before: func(t *testing.T, db *kfntest.PG) {
				if _, err := db.Pool.Exec(context.Background(), `UPDATE kfn.dead_letters SET retry_requested_at = now(), retry_actor = 'ops' WHERE "offset" = 2`); err != nil {
					t.Fatal(err)
				}
			},
			after: func(t *testing.T, db *kfntest.PG, dead []inbox.DeadLetter) {
				ctx := context.Background()
				if held, err := inbox.HeldKeys(ctx, db.Pool, part); err != nil || len(held) != 0 {
					t.Fatalf("held keys after migrating = %+v, %v; want none", held, err)
				}
				if lanes, err := inbox.PendingRetryLanes(ctx, db.Pool, []string{"fn"}); err != nil || len(lanes) != 1 {
					t.Errorf("lanes with pending retries = %v, %v; want the migrated mark kept", lanes, err)
				}
				// The new table works with the old letters: park the key of
				// offset 1 behind it, with a record parked after it, then
				// discard it.
				err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
					if err := inbox.ParkKey(ctx, tx, part, []byte{0, 0xff}, 1); err != nil {
						return err
					}
					_, err := inbox.WriteDeadLetter(ctx, tx, inbox.DeadLetter{Partition: part, Offset: 3, Key: []byte{0, 0xff}, Value: []byte("v3"),
						Reason: inbox.ReasonKeyParked, Error: inbox.KeyParkedError(1)})
					return err
				})
				if err != nil {
					t.Fatal(err)
				}
				held, err := inbox.HeldKeys(ctx, db.Pool, part)
				if err != nil || len(held) != 1 || held[0].Offset != 1 || held[0].Released {
					t.Fatalf("held keys = %+v, %v; want the key blocked at offset 1", held, err)
				}
				var released []inbox.ReleasedKey
				err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) (err error) {
					_, released, err = inbox.DiscardAndRelease(ctx, tx, inbox.DeadLetterFilter{IDs: []int64{dead[0].ID}}, "ops", "after the upgrade")
					return err
				})
				if err != nil || len(released) != 1 || released[0].Marked != 1 {
					t.Fatalf("discard of the blocker released %+v, %v; want the key with its parked record marked", released, err)
				}
			}},
		{name: "15 stores the error fingerprint", version: 15,
			before: func(t *testing.T, db *kfntest.PG) {
				if _, err := db.Pool.Exec(context.Background(), `UPDATE kfn.dead_letters SET error = 'order ' || (4411 * "offset") || ' not found'`); err != nil {
					t.Fatal(err)
				}
			},
			after: func(t *testing.T, db *kfntest.PG, _ []inbox.DeadLetter) {
				ctx := context.Background()
				fingerprints := func() map[int64]string {
					t.Helper()
					rows, err := db.Pool.Query(ctx, `SELECT "offset", coalesce(error_fingerprint, 'NULL') FROM kfn.dead_letters`)
					if err != nil {
						t.Fatal(err)
					}
					got := map[int64]string{}
					for rows.Next() {
						var offset int64
						var fp string
						if err := rows.Scan(&offset, &fp); err != nil {
							t.Fatal(err)
						}
						got[offset] = fp
					}
					return got
				}
				// The migration fills the letters already there.
				if got := fingerprints(); got[1] != "order <n> not found" || got[2] != "order <n> not found" {
					t.Fatalf("fingerprints of the migrated letters = %v, want order <n> not found", got)
				}
				// A letter written as every worker writes one (a worker built
				// for version 14 the same: the column is not in its INSERT),
				// written again over its conflict, and its error rewritten.
				write := func(errText string) {
					t.Helper()
					err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
						_, err := inbox.WriteDeadLetter(ctx, tx, inbox.DeadLetter{Partition: part, Offset: 3, Value: []byte("v3"), Reason: "permanent", Error: errText})
						return err
					})
					if err != nil {
						t.Fatal(err)
					}
				}
				write("charge 550e8400-e29b-41d4-a716-446655440000 failed: HTTP 502")
				if got := fingerprints()[3]; got != "charge <id> failed: HTTP <n>" {
					t.Errorf("the fingerprint of a new letter = %q", got)
				}
				write("timeout after 30 s")
				if got := fingerprints()[3]; got != "timeout after <n> s" {
					t.Errorf("the fingerprint of a letter written again = %q", got)
				}
				if _, err := db.Pool.Exec(ctx, `UPDATE kfn.dead_letters SET error = 'key 77 blocked' WHERE "offset" = 3`); err != nil {
					t.Fatal(err)
				}
				if got := fingerprints()[3]; got != "key <n> blocked" {
					t.Errorf("the fingerprint after the error is rewritten = %q", got)
				}
			}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			db := kfntest.PostgresEmpty(t)
			ctx := context.Background()
			if _, err := schema.MigrateTo(ctx, db.Pool, tc.version-1); err != nil {
				t.Fatal(err)
			}
			// Written as a worker of the version before writes them (the
			// same columns).
			written := []inbox.DeadLetter{
				{Partition: part, Offset: 1, Key: []byte{0, 0xff}, Value: []byte("v1"), Headers: []inbox.Header{{Key: []byte("h"), Value: nil}},
					Reason: "permanent", Error: "bad", Attempts: 1},
				{Partition: part, Offset: 2, Key: []byte("k"), Value: []byte("v2"), Reason: "handler_error", Error: "down", Attempts: 5},
			}
			err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
				for _, d := range written {
					if _, err := inbox.WriteDeadLetter(ctx, tx, d); err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if tc.before != nil {
				tc.before(t, db)
			}

			applied, err := schema.Migrate(ctx, db.Pool)
			var want []int // this version and every later one
			for _, m := range schema.Migrations() {
				if m.Version >= tc.version {
					want = append(want, m.Version)
				}
			}
			if err != nil || !slices.Equal(applied, want) {
				t.Fatalf("Migrate = %v, %v; want %v applied", applied, err, want)
			}
			if err := schema.Check(ctx, db.Pool); err != nil {
				t.Fatalf("Check after migrating: %v", err)
			}
			dead, err := inbox.ListDeadLetters(ctx, db.Pool, "fn", 10)
			if err != nil || len(dead) != 2 || string(dead[0].Key) != "\x00\xff" || string(dead[0].Value) != "v1" || len(dead[0].Headers) != 1 ||
				string(dead[1].Key) != "k" || string(dead[1].Value) != "v2" {
				t.Fatalf("dead letters after migrating = %+v, %v", dead, err)
			}
			tc.after(t, db, dead)
		})
	}
}

// BenchmarkMigration15 measures migration 0015 on 100,000 dead letters of
// schema 14 (the console benchmark's error texts): the fingerprint of
// every letter and its index, in the migration's transaction, which holds
// the dead letters' lock.
//
//	go test ./internal/schema -run '^$' -bench BenchmarkMigration15 -benchtime 3x
func BenchmarkMigration15(b *testing.B) {
	benchMigration(b, 15, 100_000, `INSERT INTO kfn.dead_letters (consumer, topic, partition, "offset", value, reason, error, attempts)
SELECT 'bench', 'orders', i % 64, i, convert_to('{"order":' || i || '}', 'UTF8'), (ARRAY['handler_error', 'permanent', 'data_error'])[1 + i % 3],
       (ARRAY['order ', 'decode: bad byte at ', 'timeout after '])[1 + i % 3] || i || ' in ' || md5(i::text), 5
  FROM generate_series(1, $1) AS i`, schema.MigrateTo)
}
