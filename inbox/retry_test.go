package inbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// A retry marks letters (refusing what cannot be rebuilt), a lane takes
// each one at most once under its fence, and a failed retry leaves the
// letter with its attempts counted.
func TestRetryMarksLettersAndTakesEachOnce(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, 1, "w", 0); err != nil {
		t.Fatal(err)
	}
	hostile := hostileDeadLetter(3)
	oversized := inbox.DeadLetter{Partition: part, Offset: 4, Value: []byte("prefix"), ValueSize: 1 << 20, ValueSHA256: make([]byte, 32),
		Reason: "oversized", Error: "too big"}
	raw := hostileDeadLetter(6)
	raw.StoredRaw = true
	err := inTx(t, db, func(tx pgx.Tx) error {
		for _, d := range []inbox.DeadLetter{hostile, oversized, raw} {
			if err := inbox.MarkDeadLettered(ctx, tx, part, 1, d.Offset); err != nil {
				return err
			}
			if _, err := inbox.WriteDeadLetter(ctx, tx, d); err != nil {
				return err
			}
		}
		// A record parked without its bytes (no --kafka-brokers).
		_, err := inbox.Park(ctx, tx, inbox.ParkRequest{Partition: part, Token: 1, Offset: 5, Actor: "ops", Reason: "stuck"})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	ids := map[int64]int64{} // offset → dead letter id
	rows, _ := db.Pool.Query(ctx, `SELECT "offset", id FROM kfn.dead_letters`)
	var o, id int64
	if _, err := pgx.ForEachRow(rows, []any{&o, &id}, func() error { ids[o] = id; return nil }); err != nil {
		t.Fatal(err)
	}

	listen, err := pgx.Connect(ctx, db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer listen.Close(ctx)
	if _, err := listen.Exec(ctx, "LISTEN "+inbox.RetryNotifyChannel); err != nil {
		t.Fatal(err)
	}

	mark := func(r inbox.RetryRequest) (inbox.RetryMarks, error) {
		var res inbox.RetryMarks
		err := inTx(t, db, func(tx pgx.Tx) (err error) {
			res, err = inbox.MarkForRetry(ctx, tx, r)
			return err
		})
		return res, err
	}
	if _, err := mark(inbox.RetryRequest{RetrySelection: inbox.RetrySelection{Function: part.Consumer, Partition: -1}, Actor: "ops"}); err == nil {
		t.Error("a retry without a reason was accepted")
	}
	marks, err := mark(inbox.RetryRequest{
		RetrySelection: inbox.RetrySelection{Function: part.Consumer, Partition: -1, IDs: []int64{ids[3], ids[4], ids[5], ids[6], 999999}},
		Actor:          "ops", Reason: "INC-9: fixed",
	})
	if err != nil {
		t.Fatal(err)
	}
	var marked, refused []int64
	for _, m := range marks.Marked {
		marked = append(marked, m.Offset)
	}
	for _, m := range marks.Refused {
		refused = append(refused, m.ID)
	}
	if !slices.Equal(marked, []int64{3, 6}) || !slices.Equal(refused, []int64{ids[4], ids[5], 999999}) {
		t.Fatalf("marked offsets %v, refused ids %v; want 3 and 6 marked, the oversized, the parked one without bytes and the unknown id refused", marked, refused)
	}
	for _, m := range marks.Refused[:2] {
		if !strings.Contains(m.Refused, "kfn replay") {
			t.Errorf("refusal of %d = %q; want it to point at kfn replay", m.ID, m.Refused)
		}
	}
	nctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	n, err := listen.WaitForNotification(nctx)
	cancel()
	if err != nil || n.Payload != part.Consumer {
		t.Errorf("notification = %+v, %v; want one naming %s", n, err, part.Consumer)
	}
	var audits int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.audit_log WHERE action = $1 AND actor = 'ops' AND details->>'reason' = 'INC-9: fixed'`,
		inbox.ActionRetryRequested).Scan(&audits); err != nil || audits != 2 {
		t.Errorf("%d dlq_retry_requested audit rows (%v), want 2", audits, err)
	}
	lanes, err := inbox.PendingRetryLanes(ctx, db.Pool, []string{part.Consumer, "other"})
	if err != nil || !slices.Equal(lanes, []inbox.Partition{part}) {
		t.Errorf("lanes with pending retries = %v, %v; want %v", lanes, err, part)
	}
	pending, err := inbox.PendingRetries(ctx, db.Pool, part, 10)
	if err != nil || !slices.Equal(pending, []int64{ids[3], ids[6]}) {
		t.Errorf("pending retries = %v, %v; want %v in offset order", pending, err, []int64{ids[3], ids[6]})
	}

	// The fence: only the lane's token, and the cursor stays.
	err = inTx(t, db, func(tx pgx.Tx) error { return inbox.FenceLane(ctx, tx, part, 2) })
	if !errors.Is(err, inbox.ErrFenced) {
		t.Errorf("FenceLane with a stale token: %v, want fenced", err)
	}
	take := func(id int64, then func(tx pgx.Tx, l inbox.RetryLetter) error) (inbox.RetryLetter, bool, error) {
		var l inbox.RetryLetter
		var found bool
		err := inTx(t, db, func(tx pgx.Tx) (err error) {
			if err := inbox.FenceLane(ctx, tx, part, 1); err != nil {
				return err
			}
			if l, found, err = inbox.TakeForRetry(ctx, tx, part, id); err != nil || !found {
				return err
			}
			return then(tx, l)
		})
		return l, found, err
	}
	rollback := errors.New("roll back")
	l, found, err := take(ids[3], func(pgx.Tx, inbox.RetryLetter) error { return rollback })
	if !found || !errors.Is(err, rollback) || l.Actor != "ops" || l.Why != "INC-9: fixed" || l.Attempts != 1 {
		t.Fatalf("take = %+v, %v, %v", l, found, err)
	}
	requireSameRecord(t, l.DeadLetter, hostile)
	l, found, err = take(ids[3], func(tx pgx.Tx, l inbox.RetryLetter) error {
		if err := inbox.MarkRetryApplied(ctx, tx, part, 1, l.Offset); err != nil {
			return err
		}
		return inbox.AuditRetryApplied(ctx, tx, "w", l, 1, "")
	})
	if !found || err != nil {
		t.Fatalf("take after a rollback = %v, %v; want the letter back and applied", found, err)
	}
	if _, found, err := take(ids[3], nil); found || err != nil {
		t.Errorf("second take = %v, %v; want nothing to take", found, err)
	}
	var outcome string
	if err := db.Pool.QueryRow(ctx, `SELECT outcome FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = $1 AND topic = $2 AND partition = $3 AND "offset" = 3`,
		part.Consumer, part.Topic, part.Partition).Scan(&outcome); err != nil || outcome != "applied" {
		t.Errorf("inbox outcome of offset 3 = %q, %v; want applied", outcome, err)
	}
	if cur, err := inbox.ReadCursor(ctx, db.Pool, part); err != nil || cur.NextOffset != 0 {
		t.Errorf("cursor = %+v, %v; want it where it was (0)", cur, err)
	}

	// The raw one fails: it stays, unmarked, attempts counted.
	l, found, err = take(ids[6], func(pgx.Tx, inbox.RetryLetter) error { return rollback })
	if !found || !errors.Is(err, rollback) {
		t.Fatal(found, err)
	}
	requireSameRecord(t, l.DeadLetter, raw)
	var recorded bool
	err = inTx(t, db, func(tx pgx.Tx) (err error) {
		recorded, err = inbox.RetryFailed(ctx, tx, "w", l, 1, "still broken\x00")
		return err
	})
	if err != nil || !recorded {
		t.Fatalf("RetryFailed = %v, %v", recorded, err)
	}
	err = inTx(t, db, func(tx pgx.Tx) (err error) {
		recorded, err = inbox.RetryFailed(ctx, tx, "w", l, 1, "again")
		return err
	})
	if err != nil || recorded {
		t.Errorf("RetryFailed of a letter no longer marked = %v, %v; want nothing recorded", recorded, err)
	}
	var attempts int
	var lastErr string
	var requested *time.Time
	if err := db.Pool.QueryRow(ctx, `SELECT attempts, last_retry_error, retry_requested_at FROM kfn.dead_letters WHERE id = $1`, ids[6]).
		Scan(&attempts, &lastErr, &requested); err != nil || attempts != 2 || lastErr != `still broken\x00` || requested != nil {
		t.Errorf("failed letter: attempts %d, last error %q, requested %v (%v); want 2, the error, unmarked", attempts, lastErr, requested, err)
	}

	outcomes, err := inbox.RetryOutcomes(ctx, db.Pool, marks.AuditMark, []int64{ids[3], ids[6], ids[4], 999999})
	if err != nil {
		t.Fatal(err)
	}
	for id, want := range map[int64]string{ids[3]: inbox.RetryApplied, ids[6]: inbox.RetryFailedAgain, ids[4]: inbox.RetryPending, 999999: inbox.RetryGone} {
		if outcomes[id].Outcome != want {
			t.Errorf("outcome of %d = %+v, want %s", id, outcomes[id], want)
		}
	}
	if o := outcomes[ids[6]]; o.Error != `still broken\x00` || o.By != "w" {
		t.Errorf("failed outcome = %+v; want the error and the worker", o)
	}

	// The inbox refuses a record applied since it was dead-lettered.
	err = inTx(t, db, func(tx pgx.Tx) error {
		if _, err := inbox.Claim(ctx, tx, part, 1, inbox.Applied, []int64{7}); err != nil {
			return err
		}
		return inbox.MarkRetryApplied(ctx, tx, part, 1, 7)
	})
	if !errors.Is(err, inbox.ErrAlreadyApplied) {
		t.Errorf("MarkRetryApplied of an applied record: %v, want ErrAlreadyApplied", err)
	}
	ev := inbox.EventRef{ID: "e-1", Subject: "orders.accepted", StreamSeq: 9}
	err = inTx(t, db, func(tx pgx.Tx) error {
		if err := inbox.MarkEventDeadLettered(ctx, tx, "ledger", 1, ev); err != nil {
			return err
		}
		subject, err := inbox.MarkEventRetryApplied(ctx, tx, "ledger", 1, inbox.EventRef{ID: "e-1", Subject: "orders.*", StreamSeq: 9})
		if err != nil || subject != ev.Subject {
			t.Errorf("MarkEventRetryApplied = %q, %v; want the stored subject %q", subject, err, ev.Subject)
		}
		_, err = inbox.MarkEventRetryApplied(ctx, tx, "ledger", 1, ev)
		return err
	})
	if !errors.Is(err, inbox.ErrAlreadyApplied) {
		t.Errorf("MarkEventRetryApplied twice: %v, want ErrAlreadyApplied", err)
	}
}
