package schema_test

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/schema"
)

// TestMigration6AddsDeadLetterRetryToExistingDeadLetters migrates a database
// at version 5 holding dead letters: they keep every byte, no retry is
// pending, and they can be marked for retry.
func TestMigration6AddsDeadLetterRetryToExistingDeadLetters(t *testing.T) {
	db := kfntest.PostgresEmpty(t)
	ctx := context.Background()
	for _, m := range schema.Migrations() {
		if m.Version > 5 {
			break
		}
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO kfn.schema_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name)
			return err
		})
		if err != nil {
			t.Fatalf("apply %s: %v", m.Name, err)
		}
	}
	if v, err := schema.Version(ctx, db.Pool); err != nil || v != 5 {
		t.Fatalf("version = %d, %v; want 5", v, err)
	}
	part := inbox.Partition{Consumer: "fn", Topic: "orders", Partition: 0}
	written := []inbox.DeadLetter{
		{Partition: part, Offset: 1, Key: []byte{0, 0xff}, Value: []byte("v1"), Headers: []inbox.Header{{Key: []byte("h"), Value: nil}},
			Reason: "permanent", Error: "bad", Attempts: 1},
		{Partition: part, Offset: 2, Reason: "handler_error", Error: "down", Attempts: 5},
	}
	// Written as a version 5 worker writes them (the same columns).
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

	applied, err := schema.Migrate(ctx, db.Pool)
	var want []int // 6 and every later version
	for v := 6; v <= schema.Latest(); v++ {
		want = append(want, v)
	}
	if err != nil || !slices.Equal(applied, want) {
		t.Fatalf("Migrate = %v, %v; want %v applied", applied, err, want)
	}
	if err := schema.Check(ctx, db.Pool); err != nil {
		t.Fatalf("Check after migrating: %v", err)
	}
	dead, err := inbox.ListDeadLetters(ctx, db.Pool, "fn", 10)
	if err != nil || len(dead) != 2 || string(dead[0].Key) != "\x00\xff" || string(dead[0].Value) != "v1" || len(dead[0].Headers) != 1 {
		t.Fatalf("dead letters after migrating = %+v, %v", dead, err)
	}
	var pending int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.dead_letters WHERE retry_requested_at IS NOT NULL OR last_retry_at IS NOT NULL`).Scan(&pending); err != nil || pending != 0 {
		t.Errorf("%d migrated letters with retry state (%v), want none", pending, err)
	}
	var marks inbox.RetryMarks
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) (err error) {
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
}
