package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// A change of the lane count, as ClaimLane makes it: the old lanes are
// fenced (their commits fail), the new lanes start at the slowest old
// lane's cursor, lanes beyond the new count are gone, and a worker started
// before the change with the old count is refused with a message naming
// the setting.
func TestChangingTheLaneCountFencesOldLanesAndStartsAtTheSlowest(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	lane := func(k int32) inbox.Partition {
		return inbox.Partition{Consumer: "ledger", Topic: "orders.accepted", Partition: k}
	}
	oldStart := time.Now().Add(-time.Hour)

	// Four lanes, claimed by w-old with tokens 10–13, at different progress.
	for k := range int32(4) {
		if _, err := inbox.ClaimLane(ctx, db.Pool, lane(k), 4, 10+int64(k), "w-old", oldStart, 1, time.Second); err != nil {
			t.Fatalf("claim lane %d of 4: %v", k, err)
		}
		seq := []int64{500, 120, 900, 300}[k]
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return inbox.Fence(ctx, tx, lane(k), 10+int64(k), seq) }); err != nil {
			t.Fatalf("fence lane %d: %v", k, err)
		}
	}

	// A worker started now with 2 lanes claims lane 1 with token 20.
	cur, err := inbox.ClaimLane(ctx, db.Pool, lane(1), 2, 20, "w-new", time.Now(), 1, time.Second)
	if err != nil {
		t.Fatalf("claim lane 1 of 2: %v", err)
	}
	if cur.NextOffset != 121 || cur.Epoch != 20 {
		t.Errorf("new lane 1 = %+v, want next 121 (the slowest old lane's) and epoch 20", cur)
	}
	// Old lane 2 (beyond the new count) and old lane 0 can no longer commit.
	for _, k := range []int32{0, 2} {
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return inbox.Fence(ctx, tx, lane(k), 10+int64(k), 1000) })
		if !errors.Is(err, inbox.ErrFenced) {
			t.Errorf("old lane %d committing after the change: err = %v, want fenced", k, err)
		}
	}
	var rows int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.cursors WHERE consumer = 'ledger'`).Scan(&rows); err != nil || rows != 2 {
		t.Errorf("%d cursor rows after the change to 2 lanes (%v), want 2", rows, err)
	}
	// The other new lane starts there too, with its own token.
	if cur, err := inbox.ClaimLane(ctx, db.Pool, lane(0), 2, 21, "w-new2", time.Now(), 1, time.Second); err != nil || cur.NextOffset != 121 {
		t.Errorf("claim lane 0 of 2 = %+v, %v; want next 121", cur, err)
	}

	// The old worker, started before the change, is refused, even with a
	// newer token: it would split the keys the old way.
	_, err = inbox.ClaimLane(ctx, db.Pool, lane(3), 4, 30, "w-old", oldStart, 1, time.Second)
	var stale *inbox.LaneCountError
	if !errors.As(err, &stale) || stale.Recorded != 2 || stale.Configured != 4 {
		t.Fatalf("old worker's claim: err = %v, want a LaneCountError (recorded 2, configured 4)", err)
	}
	t.Logf("refusal: %v", err)

	// A change by a token older than a lane's epoch is refused as fenced:
	// its next lease term retries with a newer one.
	_, err = inbox.ClaimLane(ctx, db.Pool, lane(0), 3, 15, "w-third", time.Now(), 1, time.Second)
	if !errors.Is(err, inbox.ErrFenced) {
		t.Errorf("change with a token below the lanes' epochs: err = %v, want fenced", err)
	}
}
