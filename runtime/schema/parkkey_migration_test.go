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

// TestMigration7AddsParkedKeysToADatabaseWithDeadLetters migrates a
// database at version 6 holding dead letters (one marked for retry): they
// are unchanged, no key is parked, and keys can then be parked behind them
// and released by a discard.
func TestMigration7AddsParkedKeysToADatabaseWithDeadLetters(t *testing.T) {
	db := kfntest.PostgresEmpty(t)
	ctx := context.Background()
	for _, m := range schema.Migrations() {
		if m.Version > 6 {
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
	if v, err := schema.Version(ctx, db.Pool); err != nil || v != 6 {
		t.Fatalf("version = %d, %v; want 6", v, err)
	}
	part := inbox.Partition{Consumer: "fn", Topic: "orders", Partition: 0}
	written := []inbox.DeadLetter{
		{Partition: part, Offset: 1, Key: []byte{0, 0xff}, Value: []byte("v1"), Reason: "permanent", Error: "bad", Attempts: 1},
		{Partition: part, Offset: 2, Key: []byte("k"), Value: []byte("v2"), Reason: "handler_error", Error: "down", Attempts: 5},
	}
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		for _, d := range written {
			if _, err := inbox.WriteDeadLetter(ctx, tx, d); err != nil {
				return err
			}
		}
		_, err := tx.Exec(ctx, `UPDATE kfn.dead_letters SET retry_requested_at = now(), retry_actor = 'ops' WHERE "offset" = 2`)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}

	applied, err := schema.Migrate(ctx, db.Pool)
	if err != nil || !slices.Equal(applied, []int{7}) {
		t.Fatalf("Migrate = %v, %v; want [7] applied", applied, err)
	}
	if err := schema.Check(ctx, db.Pool); err != nil {
		t.Fatalf("Check after migrating: %v", err)
	}
	dead, err := inbox.ListDeadLetters(ctx, db.Pool, "fn", 10)
	if err != nil || len(dead) != 2 || string(dead[0].Key) != "\x00\xff" || string(dead[1].Value) != "v2" {
		t.Fatalf("dead letters after migrating = %+v, %v", dead, err)
	}
	if held, err := inbox.HeldKeys(ctx, db.Pool, part); err != nil || len(held) != 0 {
		t.Fatalf("held keys after migrating = %+v, %v; want none", held, err)
	}
	if lanes, err := inbox.PendingRetryLanes(ctx, db.Pool, []string{"fn"}); err != nil || len(lanes) != 1 {
		t.Errorf("lanes with pending retries = %v, %v; want the migrated mark kept", lanes, err)
	}

	// The new table works with the old letters: park the key of offset 1
	// behind it, with a record parked after it, then discard it.
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
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
}
