package inbox_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

var part = inbox.Partition{Consumer: "fn", Topic: "orders", Partition: 3}

func inTx(t *testing.T, db *kfntest.PG, f func(tx pgx.Tx) error) error {
	t.Helper()
	return pgx.BeginFunc(context.Background(), db.Pool, f)
}

func TestClaimPartitionOnlyAcceptsALargerToken(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	cur, err := inbox.ClaimPartition(ctx, db.Pool, part, 10, "w1", 42)
	if err != nil {
		t.Fatal(err)
	}
	if cur.NextOffset != 42 || cur.HighWater != 42 || cur.Epoch != 10 {
		t.Errorf("new cursor = %+v, want next 42, high water 42, epoch 10", cur)
	}
	if cur, err := inbox.ClaimPartition(ctx, db.Pool, part, 10, "w1", 0); err != nil || cur.Epoch != 10 {
		t.Errorf("the same owner claiming again with its token (a retry after a lost reply) = %+v, %v; want success", cur, err)
	}
	for _, stale := range []int64{9, 10} {
		_, err := inbox.ClaimPartition(ctx, db.Pool, part, stale, "w2", 0)
		var fenced *inbox.FencedError
		if !errors.As(err, &fenced) || fenced.Epoch != 10 || !errors.Is(err, inbox.ErrFenced) {
			t.Errorf("claim with token %d: err = %v, want FencedError with epoch 10", stale, err)
		}
	}
	cur, err = inbox.ClaimPartition(ctx, db.Pool, part, 11, "w2", 0)
	if err != nil || cur.Epoch != 11 || cur.Owner != "w2" || cur.NextOffset != 42 {
		t.Errorf("claim with token 11 = %+v, %v; want epoch 11, owner w2, cursor kept at 42", cur, err)
	}
}

// Every accepted claim leaves a "claim" row in the audit log, committed
// with it: the epoch history the exactly-once checker and kfn verify read,
// with the cursor the claim found. A refused claim, or one whose
// transaction rolls back, leaves none.
func TestClaimsAreAuditedWithTheirEpochAndWALPosition(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, 10, "w1", 0); err != nil {
		t.Fatal(err)
	}
	if err := inTx(t, db, func(tx pgx.Tx) error { return inbox.Advance(ctx, tx, part, 10, 0, 7) }); err != nil {
		t.Fatal(err)
	}
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, 9, "w0", 0); !errors.Is(err, inbox.ErrFenced) {
		t.Fatalf("stale claim: err = %v, want fenced", err)
	}
	rolledBack := errors.New("roll back")
	err := inTx(t, db, func(tx pgx.Tx) error {
		if _, err := inbox.ClaimPartition(ctx, tx, part, 11, "w2", 0); err != nil {
			return err
		}
		return rolledBack
	})
	if !errors.Is(err, rolledBack) {
		t.Fatalf("claim in a rolled-back transaction: %v", err)
	}
	err = inTx(t, db, func(tx pgx.Tx) error {
		_, err := inbox.ClaimPartition(ctx, tx, part, 12, "w3", 0)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	type claim struct {
		Actor, Owner          string
		Epoch                 int64
		Before                bool // its lsn is before the current WAL position
		NextOffset, HighWater int64
	}
	rows, err := db.Pool.Query(ctx, `
SELECT actor, details->>'owner', (details->>'epoch')::bigint, (details->>'lsn')::pg_lsn < pg_current_wal_insert_lsn(),
       (details->>'next_offset')::bigint, (details->>'high_water')::bigint
  FROM kfn.audit_log WHERE action = $1 AND consumer = $2 AND topic = $3 AND partition = $4 ORDER BY id`,
		inbox.ActionClaim, part.Consumer, part.Topic, part.Partition)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[claim])
	if err != nil {
		t.Fatal(err)
	}
	want := []claim{{"w1", "w1", 10, true, 0, 0}, {"w3", "w3", 12, true, 7, 7}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("claim audit rows = %+v, want %+v (the refused and the rolled-back claims leave none)", got, want)
	}
}

func TestAdvanceIsFencedByTokenAndCursor(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, 5, "old", 0); err != nil {
		t.Fatal(err)
	}
	if err := inTx(t, db, func(tx pgx.Tx) error { return inbox.Advance(ctx, tx, part, 5, 0, 10) }); err != nil {
		t.Fatalf("owner advance: %v", err)
	}
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, 6, "new", 0); err != nil {
		t.Fatal(err)
	}
	err := inTx(t, db, func(tx pgx.Tx) error { return inbox.Advance(ctx, tx, part, 5, 10, 20) })
	if !errors.Is(err, inbox.ErrFenced) {
		t.Errorf("old owner advance after takeover: err = %v, want fenced", err)
	}
	// Same token, wrong position: not fenced, the cursor moved (the
	// owner's own earlier commit landed), and the error carries it.
	err = inTx(t, db, func(tx pgx.Tx) error { return inbox.Advance(ctx, tx, part, 6, 7, 20) })
	var moved *inbox.CursorMovedError
	if errors.Is(err, inbox.ErrFenced) || !errors.As(err, &moved) || moved.Cursor.NextOffset != 10 || moved.Cursor.Epoch != 6 {
		t.Errorf("advance from a position that is not the cursor, same token: err = %v, want a CursorMovedError at 10 (not fenced)", err)
	}
	cur, err := inbox.ReadCursor(ctx, db.Pool, part)
	if err != nil || cur.NextOffset != 10 || cur.HighWater != 10 {
		t.Errorf("cursor = %+v, %v; want it left at 10", cur, err)
	}
}

// QueueFenceAndClaim is Advance and Claim in one statement: it claims only the
// fresh offsets, and claims nothing when the fence refuses (a stale token,
// or a cursor that is not where the caller moves it from).
func TestQueueFenceAndClaimClaimsOnlyBehindTheFence(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, 5, "old", 0); err != nil {
		t.Fatal(err)
	}
	claim := func(token, from, to int64, offsets ...int64) (fresh []int64, err error) {
		err = inTx(t, db, func(tx pgx.Tx) (err error) {
			b := &pgx.Batch{}
			result := inbox.QueueFenceAndClaim(b, part, token, from, to, offsets)
			if err := tx.SendBatch(ctx, b).Close(); err != nil {
				return err
			}
			fresh, err = result(ctx, tx)
			return err
		})
		return fresh, err
	}
	if fresh, err := claim(5, 0, 3, 0, 1, 2); err != nil || len(fresh) != 3 {
		t.Fatalf("owner's first batch: fresh %v, %v; want [0 1 2]", fresh, err)
	}
	// Offset 2 is claimed already (say a replay moved the cursor back).
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, 6, "new", 0); err != nil {
		t.Fatal(err)
	}
	if fresh, err := claim(6, 3, 5, 2, 3, 4); err != nil || len(fresh) != 2 || fresh[0] != 3 || fresh[1] != 4 {
		t.Errorf("batch with a handled offset: fresh %v, %v; want [3 4]", fresh, err)
	}
	if _, err := claim(5, 5, 7, 5, 6); !errors.Is(err, inbox.ErrFenced) {
		t.Errorf("old owner after takeover: err = %v, want fenced", err)
	}
	var moved *inbox.CursorMovedError
	if _, err := claim(6, 3, 7, 5, 6); errors.Is(err, inbox.ErrFenced) || !errors.As(err, &moved) || moved.Cursor.NextOffset != 5 {
		t.Errorf("same token, cursor elsewhere: err = %v, want a CursorMovedError at 5", err)
	}
	var claimed int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = $1`, part.Consumer).Scan(&claimed); err != nil || claimed != 5 {
		t.Errorf("%d inbox rows (%v); want 5: refused batches claim nothing", claimed, err)
	}
	cur, err := inbox.ReadCursor(ctx, db.Pool, part)
	if err != nil || cur.NextOffset != 5 || cur.HighWater != 5 {
		t.Errorf("cursor = %+v, %v; want 5", cur, err)
	}
	// Offsets out of order, one twice: claimed as a set, each once.
	if fresh, err := claim(6, 5, 8, 7, 5, 7, 6); err != nil || !slices.Equal(fresh, []int64{5, 6, 7}) {
		t.Errorf("offsets out of order and repeated: fresh %v, %v; want [5 6 7]", fresh, err)
	}
}

func TestClaimReturnsOnlyFreshOffsets(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	var first, second []int64
	err := inTx(t, db, func(tx pgx.Tx) (err error) {
		first, err = inbox.Claim(ctx, tx, part, 1, inbox.Applied, []int64{1, 2, 3})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	err = inTx(t, db, func(tx pgx.Tx) (err error) {
		second, err = inbox.Claim(ctx, tx, part, 1, inbox.Applied, []int64{2, 3, 4, 5})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(first) != 3 || len(second) != 2 || second[0] != 4 || second[1] != 5 {
		t.Errorf("fresh = %v then %v, want [1 2 3] then [4 5]", first, second)
	}
}

func TestPurgeKeepsDedupAtTheHighWaterMark(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, 1, "w", 0); err != nil {
		t.Fatal(err)
	}
	offsets := make([]int64, 250)
	for i := range offsets {
		offsets[i] = int64(i)
	}
	err := inTx(t, db, func(tx pgx.Tx) error {
		if err := inbox.Advance(ctx, tx, part, 1, 0, 200); err != nil { // 200..249 are above the high-water mark
			return err
		}
		_, err := inbox.Claim(ctx, tx, part, 1, inbox.Applied, offsets)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE kfn.inbox SET processed_at = now() - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	n, err := inbox.Purge(ctx, db.Pool, time.Hour, 64)
	if err != nil || n != 200 {
		t.Fatalf("purged %d, %v; want 200 (only rows below the high-water mark)", n, err)
	}
	var left int64
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.inbox`).Scan(&left); err != nil || left != 50 {
		t.Errorf("left %d rows, want 50", left)
	}
	if n, _ := inbox.Purge(ctx, db.Pool, time.Hour, 64); n != 0 {
		t.Errorf("second purge removed %d, want 0", n)
	}
}

// Retention reads the primary key only: each partition's rows go in
// offset order, and the first row that must stay (younger than the
// retention, like a record re-executed or a dead letter retried later)
// holds back the rows after it until it is old enough itself.
func TestPurgeGoesInOffsetOrderAndStopsAtTheFirstYoungRow(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	other := inbox.Partition{Consumer: part.Consumer, Topic: part.Topic, Partition: part.Partition + 1}
	handled(t, db, part, 300)
	handled(t, db, other, 300)
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	exec(`UPDATE kfn.inbox SET processed_at = now() - interval '2 hours'`)
	exec(`UPDATE kfn.inbox SET processed_at = now() WHERE lane IN (SELECT id FROM kfn.lanes WHERE partition = $1) AND "offset" = 150`, part.Partition)
	left := func(p inbox.Partition) (n, lowest int64) {
		t.Helper()
		err := db.Pool.QueryRow(ctx, `SELECT count(*), coalesce(min("offset"), -1) FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE partition = $1`, p.Partition).Scan(&n, &lowest)
		if err != nil {
			t.Fatal(err)
		}
		return n, lowest
	}

	n, err := inbox.Purge(ctx, db.Pool, time.Hour, 64)
	if err != nil || n != 150+300 {
		t.Fatalf("purged %d, %v; want 450 (offsets 0..149 of one partition, all 300 of the other)", n, err)
	}
	if n, lowest := left(part); n != 150 || lowest != 150 {
		t.Errorf("%s keeps %d rows from offset %d, want 150 from offset 150 (the young row holds back the older ones after it)", part, n, lowest)
	}
	if n, _ := left(other); n != 0 {
		t.Errorf("%s keeps %d rows, want 0", other, n)
	}

	exec(`UPDATE kfn.inbox SET processed_at = now() - interval '2 hours' WHERE lane IN (SELECT id FROM kfn.lanes WHERE partition = $1) AND "offset" = 150`, part.Partition)
	if n, err := inbox.Purge(ctx, db.Pool, time.Hour, 64); err != nil || n != 150 {
		t.Fatalf("once the row at 150 is old: purged %d, %v; want the 150 rows left", n, err)
	}
}

func TestReplayModes(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	handled100(t, db)
	replay := func(r inbox.ReplayRequest) (inbox.ReplayResult, error) {
		var res inbox.ReplayResult
		err := inTx(t, db, func(tx pgx.Tx) (err error) {
			res, err = inbox.Replay(ctx, tx, r)
			return err
		})
		return res, err
	}
	if _, err := replay(inbox.ReplayRequest{Partition: part, Token: 1, From: 101, ReplayOptions: inbox.ReplayOptions{Actor: "t"}}); !errors.Is(err, inbox.ErrReplayPastHighWater) {
		t.Errorf("replay past the high-water mark: err = %v, want ErrReplayPastHighWater", err)
	}
	if _, err := replay(inbox.ReplayRequest{Partition: part, Token: 0, From: 10, ReplayOptions: inbox.ReplayOptions{Actor: "t"}}); !errors.Is(err, inbox.ErrFenced) {
		t.Errorf("replay without holding the partition: err = %v, want fenced", err)
	}
	if _, err := replay(inbox.ReplayRequest{Partition: part, Token: 1, From: 10, ReplayOptions: inbox.ReplayOptions{Reexecute: true, Actor: "t"}}); err == nil {
		t.Errorf("re-execution without a reason was accepted")
	}
	res, err := replay(inbox.ReplayRequest{Partition: part, Token: 1, From: 50, ReplayOptions: inbox.ReplayOptions{Actor: "t"}})
	if err != nil || res.Now.NextOffset != 50 || res.Now.HighWater != 100 || res.InboxReleased != 0 {
		t.Errorf("idempotent replay = %+v, %v; want cursor 50, high water kept at 100, no inbox rows released", res, err)
	}
	res, err = replay(inbox.ReplayRequest{Partition: part, Token: 1, From: 80, ReplayOptions: inbox.ReplayOptions{Reexecute: true, Actor: "t", Reason: "bug 7 fixed"}})
	if err != nil || res.Now.NextOffset != 80 || res.Now.HighWater != 80 || res.InboxReleased != 20 || res.Now.Generation != 1 {
		t.Errorf("re-execution = %+v, %v; want cursor and high water 80, 20 inbox rows released, generation 1", res, err)
	}
	var actions []string
	rows, _ := db.Pool.Query(ctx, `SELECT action || ':' || (details->>'reason') FROM kfn.audit_log WHERE action <> 'claim' ORDER BY id`)
	actions, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(actions) != 2 || actions[0] != "replay:" || actions[1] != "reexecute:bug 7 fixed" {
		t.Errorf("audit log = %v, %v; want the replay and the re-execution with its reason", actions, err)
	}
}
