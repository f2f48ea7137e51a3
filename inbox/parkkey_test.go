package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// parkedLetters writes dead letters of part (key, offset, reason) with
// their inbox rows, blocks the key of each letter whose reason is not
// key_parked behind it, and returns the letters' ids by offset.
func parkedLetters(t *testing.T, db *kfntest.PG, letters ...inbox.DeadLetter) map[int64]int64 {
	t.Helper()
	ctx := context.Background()
	err := inTx(t, db, func(tx pgx.Tx) error {
		for _, d := range letters {
			d.Partition = part
			if d.Error == "" {
				d.Error = "boom"
			}
			if err := inbox.MarkDeadLettered(ctx, tx, part, 1, d.Offset); err != nil {
				return err
			}
			if _, err := inbox.WriteDeadLetter(ctx, tx, d); err != nil {
				return err
			}
			if d.Reason != inbox.ReasonKeyParked {
				if err := inbox.ParkKey(ctx, tx, part, d.Key, d.Offset); err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	ids := map[int64]int64{}
	rows, _ := db.Pool.Query(ctx, `SELECT "offset", id FROM kfn.dead_letters`)
	var o, id int64
	if _, err := pgx.ForEachRow(rows, []any{&o, &id}, func() error { ids[o] = id; return nil }); err != nil {
		t.Fatal(err)
	}
	return ids
}

// errRollback rolls a test transaction back on purpose.
var errRollback = errors.New("rolled back on purpose")

// markedOffsets lists the offsets of part's letters marked for retry.
func markedOffsets(t *testing.T, db *kfntest.PG) []int64 {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT "offset" FROM kfn.dead_letters WHERE retry_requested_at IS NOT NULL ORDER BY "offset"`)
	if err != nil {
		t.Fatal(err)
	}
	offsets, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	return offsets
}

func heldKeys(t *testing.T, db *kfntest.PG) string {
	t.Helper()
	held, err := inbox.HeldKeys(context.Background(), db.Pool, part)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, h := range held {
		s := fmt.Sprintf("%s@%d", h.Key, h.Offset)
		if h.Released {
			s += "(released)"
		}
		out = append(out, s)
	}
	slices.Sort(out)
	return strings.Join(out, " ")
}

// A key parked behind a dead letter is released when that letter is
// discarded or purged, in the same transaction: its key_parked letters are
// marked for retry, audited; a key_parked letter behind a blocker cannot be
// marked by hand, the blocker can.
func TestAParkedKeyIsReleasedByADiscardOrAPurge(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, 1, "w", 0); err != nil {
		t.Fatal(err)
	}
	kp := inbox.ReasonKeyParked
	ids := parkedLetters(t, db,
		inbox.DeadLetter{Offset: 10, Key: []byte("K"), Value: []byte("k10"), Reason: "handler_error"},
		inbox.DeadLetter{Offset: 11, Key: []byte("K"), Value: []byte("k11"), Reason: kp},
		inbox.DeadLetter{Offset: 12, Key: []byte("J"), Value: []byte("j12"), Reason: "permanent"},
		inbox.DeadLetter{Offset: 13, Key: []byte("K"), Value: []byte("k13"), Reason: kp},
		inbox.DeadLetter{Offset: 14, Key: []byte("J"), Value: []byte("j14"), Reason: kp},
	)
	if got := heldKeys(t, db); got != "J@12 K@10" {
		t.Fatalf("held keys = %q, want J@12 K@10", got)
	}

	mark := func(id int64) inbox.RetryMarks {
		t.Helper()
		var res inbox.RetryMarks
		err := inTx(t, db, func(tx pgx.Tx) (err error) {
			res, err = inbox.MarkForRetry(ctx, tx, inbox.RetryRequest{RetrySelection: inbox.RetrySelection{IDs: []int64{id}, Partition: -1}, Actor: "ops", Reason: "fixed"})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	res := mark(ids[13])
	want := fmt.Sprintf("key_parked: its key is parked behind dead letter %d (offset 10), which must be applied first", ids[10])
	if len(res.Marked) != 0 || len(res.Refused) != 1 || !strings.Contains(res.Refused[0].Refused, want) {
		t.Fatalf("marking a parked letter behind its blocker = %+v; want it refused: %q", res, want)
	}
	if res := mark(ids[10]); len(res.Marked) != 1 {
		t.Fatalf("marking the blocker = %+v; want it marked", res)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE kfn.dead_letters SET retry_requested_at = NULL`); err != nil {
		t.Fatal(err)
	}

	var released []inbox.ReleasedKey
	err := inTx(t, db, func(tx pgx.Tx) (err error) {
		_, released, err = inbox.DiscardAndRelease(ctx, tx, inbox.DeadLetterFilter{IDs: []int64{ids[10]}}, "alice", "INC-3: not to be re-driven")
		return err
	})
	if err != nil || len(released) != 1 || string(released[0].Key) != "K" || released[0].BlockingOffset != 10 || released[0].Marked != 2 {
		t.Fatalf("discarding the blocker released %+v, %v; want K with its 2 parked letters", released, err)
	}
	if got := markedOffsets(t, db); !slices.Equal(got, []int64{11, 13}) {
		t.Errorf("marked for retry = %v, want K's parked letters 11 and 13", got)
	}
	if got := heldKeys(t, db); got != "J@12 K@11(released)" {
		t.Errorf("held keys = %q, want J still blocked and K held until 11 and 13 are applied", got)
	}
	var details string
	err = db.Pool.QueryRow(ctx, `SELECT actor || ' ' || details::text FROM kfn.audit_log WHERE action = $1`, inbox.ActionKeyReleased).Scan(&details)
	if err != nil || !strings.Contains(details, `alice `) || !strings.Contains(details, `"key": "K"`) || !strings.Contains(details, `"how": "discarded"`) ||
		!strings.Contains(details, `"marked_for_retry": 2`) || !strings.Contains(details, `"blocking_offset": 10`) {
		t.Errorf("key_released audit row = %q, %v", details, err)
	}

	// Retention purges J's blocker (not its parked letter, younger): J is
	// released too.
	if _, err := db.Pool.Exec(ctx, `UPDATE kfn.dead_letters SET dead_at = now() - interval '2 hours' WHERE "offset" = 12`); err != nil {
		t.Fatal(err)
	}
	if _, n, err := inbox.PurgeDeadLetters(ctx, db.Pool, time.Hour, "worker-1", "retention"); err != nil || n != 1 {
		t.Fatalf("purge = %d, %v; want J's blocker purged", n, err)
	}
	if got := markedOffsets(t, db); !slices.Equal(got, []int64{11, 13, 14}) {
		t.Errorf("marked for retry = %v, want J's parked letter 14 too", got)
	}
	if got := heldKeys(t, db); got != "J@14(released) K@11(released)" {
		t.Errorf("held keys = %q", got)
	}
}

// A parked letter whose retry fails blocks its key in turn: the key's later
// parked letters are unmarked and name it; a parked letter behind it that
// is marked anyway is held back, unmarked, its attempts unchanged.
func TestAFailedParkedRetryBlocksItsKey(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, 1, "w", 0); err != nil {
		t.Fatal(err)
	}
	kp := inbox.ReasonKeyParked
	ids := parkedLetters(t, db,
		inbox.DeadLetter{Offset: 10, Key: []byte("K"), Value: []byte("k10"), Reason: "handler_error"},
		inbox.DeadLetter{Offset: 11, Key: []byte("K"), Value: []byte("k11"), Reason: kp},
		inbox.DeadLetter{Offset: 13, Key: []byte("K"), Value: []byte("k13"), Reason: kp},
		inbox.DeadLetter{Offset: 15, Key: []byte("K"), Value: []byte("k15"), Reason: kp},
	)
	err := inTx(t, db, func(tx pgx.Tx) error {
		_, err := inbox.DiscardDeadLetters(ctx, tx, inbox.DeadLetterFilter{IDs: []int64{ids[10]}}, "alice", "skip it")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// The lane takes 11, its handler fails: rolled back, then recorded.
	var letter inbox.RetryLetter
	err = inTx(t, db, func(tx pgx.Tx) error {
		var found bool
		var err error
		letter, found, err = inbox.TakeForRetry(ctx, tx, part, ids[11])
		if err == nil && !found {
			err = fmt.Errorf("letter %d not marked", ids[11])
		}
		if err == nil {
			err = errRollback
		}
		return err
	})
	if !errors.Is(err, errRollback) {
		t.Fatal(err)
	}
	err = inTx(t, db, func(tx pgx.Tx) error {
		if _, err := inbox.RetryFailed(ctx, tx, "w", letter, 1, "permanent: still broken"); err != nil {
			return err
		}
		blocked, err := inbox.BlockAfterFailedRetry(ctx, tx, letter, "permanent", "permanent: still broken")
		if err == nil && !blocked {
			err = fmt.Errorf("letter %d did not block its key", letter.ID)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := heldKeys(t, db); got != "K@11" {
		t.Errorf("held keys = %q, want K blocked by 11", got)
	}
	if got := markedOffsets(t, db); len(got) != 0 {
		t.Errorf("marked for retry = %v, want nothing: 13 and 15 wait behind 11", got)
	}
	var reason, errText string
	if err := db.Pool.QueryRow(ctx, `SELECT reason, error FROM kfn.dead_letters WHERE id = $1`, ids[11]).Scan(&reason, &errText); err != nil || reason != "permanent" || errText != "permanent: still broken" {
		t.Errorf("the new blocker's reason, error = %q, %q (%v); want its own failure", reason, errText, err)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT error FROM kfn.dead_letters WHERE id = $1`, ids[15]).Scan(&errText); err != nil || !strings.Contains(errText, "offset 11") {
		t.Errorf("a parked letter's error = %q (%v); want it to name offset 11", errText, err)
	}

	// 15 marked behind the lane's back (a race with a mark): held back.
	var requested time.Time
	if err := db.Pool.QueryRow(ctx, `UPDATE kfn.dead_letters SET retry_requested_at = now() WHERE id = $1 RETURNING retry_requested_at`, ids[15]).Scan(&requested); err != nil {
		t.Fatal(err)
	}
	err = inTx(t, db, func(tx pgx.Tx) error {
		blocking, behind, err := inbox.ParkedBehind(ctx, tx, part, []byte("K"), 15)
		if err != nil || !behind || blocking != 11 {
			return fmt.Errorf("ParkedBehind = %d, %v, %v; want 11", blocking, behind, err)
		}
		l := inbox.RetryLetter{DeadLetter: inbox.DeadLetter{ID: ids[15], Partition: part, Offset: 15}, RequestedAt: requested}
		ok, err := inbox.RetryHeldBack(ctx, tx, "w", l, 1, blocking)
		if err == nil && !ok {
			err = fmt.Errorf("held back nothing")
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var attempts int
	if err := db.Pool.QueryRow(ctx, `SELECT attempts FROM kfn.dead_letters WHERE id = $1 AND retry_requested_at IS NULL`, ids[15]).Scan(&attempts); err != nil || attempts != 0 {
		t.Errorf("held-back letter: attempts %d (%v); want it unmarked, attempts unchanged", attempts, err)
	}
	outcomes, err := inbox.RetryOutcomes(ctx, db.Pool, 0, []int64{ids[15]})
	if err != nil || outcomes[ids[15]].Outcome != inbox.RetryFailedAgain || !strings.Contains(outcomes[ids[15]].Error, "parked behind the dead letter at offset 11") {
		t.Errorf("held-back outcome = %+v, %v", outcomes[ids[15]], err)
	}
}

// A batch's check of a held key and a release serialise: a release that
// starts while a batch holds the key's row waits for the batch, and then
// marks what the batch parked too; a release that committed first is seen
// by the check as a released key.
func TestCheckHeldKeysAndAReleaseSerialise(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, 1, "w", 0); err != nil {
		t.Fatal(err)
	}
	kp := inbox.ReasonKeyParked
	ids := parkedLetters(t, db,
		inbox.DeadLetter{Offset: 10, Key: []byte("K"), Value: []byte("k10"), Reason: "handler_error"},
		inbox.DeadLetter{Offset: 11, Key: []byte("K"), Value: []byte("k11"), Reason: kp},
	)
	batch, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer batch.Rollback(ctx) //nolint:errcheck
	held, err := inbox.CheckHeldKeys(ctx, batch, part, [][]byte{[]byte("K"), []byte("free")})
	if err != nil || len(held) != 1 || held[0].Offset != 10 || held[0].Released {
		t.Fatalf("CheckHeldKeys = %+v, %v; want K blocked at 10 and nothing else", held, err)
	}
	discarded := make(chan error, 1)
	go func() {
		discarded <- inTx(t, db, func(tx pgx.Tx) error {
			_, err := inbox.DiscardDeadLetters(ctx, tx, inbox.DeadLetterFilter{IDs: []int64{ids[10]}}, "alice", "skip it")
			return err
		})
	}()
	select {
	case err := <-discarded:
		t.Fatalf("the discard did not wait for the batch holding its key: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	// The batch parks offset 12 behind K and commits.
	if err := inbox.MarkDeadLettered(ctx, batch, part, 1, 12); err != nil {
		t.Fatal(err)
	}
	if _, err := inbox.WriteDeadLetter(ctx, batch, inbox.DeadLetter{Partition: part, Offset: 12, Key: []byte("K"), Reason: kp, Error: inbox.KeyParkedError(10)}); err != nil {
		t.Fatal(err)
	}
	if err := batch.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-discarded; err != nil {
		t.Fatal(err)
	}
	if got := markedOffsets(t, db); !slices.Equal(got, []int64{11, 12}) {
		t.Errorf("marked for retry = %v, want 11 and the record the batch parked, 12", got)
	}
	err = inTx(t, db, func(tx pgx.Tx) error {
		held, err := inbox.CheckHeldKeys(ctx, tx, part, [][]byte{[]byte("K")})
		if err == nil && (len(held) != 1 || !held[0].Released || held[0].Offset != 11) {
			err = fmt.Errorf("CheckHeldKeys after the release = %+v; want K released, its first marked letter 11", held)
		}
		return err
	})
	if err != nil {
		t.Error(err)
	}
}
