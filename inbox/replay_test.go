package inbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// handled100 gives part a cursor at 100 with every offset below it handled
// and in the inbox, under token 1.
func handled100(t *testing.T, db *kfntest.PG) { handled(t, db, part, 100) }

// handled gives p a cursor at n with every offset below it handled and in
// the inbox, under token 1.
func handled(t *testing.T, db *kfntest.PG, p inbox.Partition, n int64) {
	t.Helper()
	ctx := context.Background()
	if _, err := inbox.ClaimPartition(ctx, db.Pool, p, 1, "w", 0); err != nil {
		t.Fatal(err)
	}
	err := inTx(t, db, func(tx pgx.Tx) error {
		if err := inbox.Advance(ctx, tx, p, 1, 0, n); err != nil {
			return err
		}
		offsets := make([]int64, n)
		for i := range offsets {
			offsets[i] = int64(i)
		}
		_, err := inbox.Claim(ctx, tx, p, 1, inbox.Applied, offsets)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

func replayIn(t *testing.T, db *kfntest.PG, r inbox.ReplayRequest) (inbox.ReplayResult, error) {
	t.Helper()
	var res inbox.ReplayResult
	err := inTx(t, db, func(tx pgx.Tx) (err error) {
		res, err = inbox.Replay(context.Background(), tx, r)
		return err
	})
	return res, err
}

func inboxOffsets(t *testing.T, db *kfntest.PG, lo, hi int64) map[int64]string {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT "offset", outcome FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = $1 AND topic = $2 AND partition = $3
   AND "offset" >= $4 AND "offset" < $5`, part.Consumer, part.Topic, part.Partition, lo, hi)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int64]string{}
	var o int64
	var outcome string
	if _, err := pgx.ForEachRow(rows, []any{&o, &outcome}, func() error { out[o] = outcome; return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// A re-execution bounded by To releases only the inbox rows of [From, To):
// the records from To on stay handled through their inbox rows, and rows
// retention purged there are written back (as dead-lettered where the
// record was), since the high-water mark no longer covers them.
func TestReexecutionToAnOffsetReleasesOnlyItsRange(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	handled100(t, db)
	// Retention purged 70..74; 72 was dead-lettered.
	if _, err := db.Pool.Exec(ctx, `DELETE FROM kfn.inbox WHERE "offset" BETWEEN 70 AND 74`); err != nil {
		t.Fatal(err)
	}
	err := inTx(t, db, func(tx pgx.Tx) error {
		_, err := inbox.WriteDeadLetter(ctx, tx, inbox.DeadLetter{Partition: part, Offset: 72, Reason: "permanent", Error: "bad", Attempts: 1})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	res, err := replayIn(t, db, inbox.ReplayRequest{Partition: part, Token: 1, From: 50, ReplayOptions: inbox.ReplayOptions{To: 60, Reexecute: true, Actor: "t", Reason: "bug 8"}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Now.NextOffset != 50 || res.Now.HighWater != 50 || res.Now.Generation != 1 || res.InboxReleased != 10 || res.InboxRestored != 5 {
		t.Errorf("re-execution [50, 60) = %+v; want cursor and high water 50, generation 1, 10 rows released, 5 written back", res)
	}
	if p := res.Plan; p.Reexecute != 10 || p.Skipped != 40 || p.InboxRestore != 5 || p.To != 60 {
		t.Errorf("plan = %+v; want 10 to re-execute, 40 skipped, 5 to write back, to 60", p)
	}
	if got := inboxOffsets(t, db, 50, 60); len(got) != 0 {
		t.Errorf("inbox rows left in [50, 60): %v", got)
	}
	after := inboxOffsets(t, db, 60, 100)
	if len(after) != 40 || after[72] != "dead_lettered" || after[71] != "applied" {
		t.Errorf("inbox rows of [60, 100) = %d (71 %q, 72 %q); want all 40, 72 dead-lettered", len(after), after[71], after[72])
	}
	if got := inboxOffsets(t, db, 0, 50); len(got) != 50 {
		t.Errorf("inbox rows of [0, 50) = %d; want all 50 untouched", len(got))
	}
	var to, restored int64
	err = db.Pool.QueryRow(ctx, `SELECT (details->>'to')::bigint, (details->>'inbox_restored')::bigint FROM kfn.audit_log WHERE action = 'reexecute'`).Scan(&to, &restored)
	if err != nil || to != 60 || restored != 5 {
		t.Errorf("audit: to %d, inbox_restored %d (%v); want 60 and 5", to, restored, err)
	}
}

func TestReplayRefusesBadRanges(t *testing.T) {
	db := kfntest.Postgres(t)
	handled100(t, db)
	cases := []struct {
		name string
		r    inbox.ReplayRequest
		want error
	}{
		{"to before from", inbox.ReplayRequest{From: 50, ReplayOptions: inbox.ReplayOptions{To: 40, Reexecute: true}}, inbox.ErrReplayRange},
		{"to equal to from", inbox.ReplayRequest{From: 50, ReplayOptions: inbox.ReplayOptions{To: 50, Reexecute: true}}, inbox.ErrReplayRange},
		{"to past the high-water mark", inbox.ReplayRequest{From: 50, ReplayOptions: inbox.ReplayOptions{To: 101, Reexecute: true}}, inbox.ErrReplayPastHighWater},
		{"an empty re-execution at the high-water mark", inbox.ReplayRequest{From: 100, ReplayOptions: inbox.ReplayOptions{Reexecute: true}}, inbox.ErrReplayRange},
		{"keep event ids of an idempotent replay", inbox.ReplayRequest{From: 50, ReplayOptions: inbox.ReplayOptions{KeepEventIDs: true}}, nil},
	}
	for _, tc := range cases {
		tc.r.Partition, tc.r.Token, tc.r.Actor, tc.r.Reason = part, 1, "t", "r"
		_, err := replayIn(t, db, tc.r)
		if err == nil || tc.want != nil && !errors.Is(err, tc.want) {
			t.Errorf("%s: err = %v, want %v", tc.name, err, tc.want)
		}
	}
	cur, err := inbox.ReadCursor(context.Background(), db.Pool, part)
	if err != nil || cur.NextOffset != 100 || cur.HighWater != 100 || cur.Generation != 0 {
		t.Errorf("cursor after refusals = %+v, %v; want it untouched", cur, err)
	}
}

// A re-execution over records whose inbox rows retention purged is refused:
// the partition's oldest row tells how far the purge went. Records Kafka no
// longer holds (below KafkaFirst) need no row.
func TestReexecutionOverPurgedInboxRowsIsRefused(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	handled100(t, db)
	if _, err := db.Pool.Exec(ctx, `DELETE FROM kfn.inbox WHERE "offset" < 20`); err != nil {
		t.Fatal(err)
	}
	req := inbox.ReplayRequest{Partition: part, Token: 1, From: 10, ReplayOptions: inbox.ReplayOptions{Reexecute: true, Actor: "t", Reason: "r"}}
	if _, err := replayIn(t, db, req); !errors.Is(err, inbox.ErrInboxPurged) {
		t.Errorf("re-execution from 10 with rows purged below 20: err = %v, want ErrInboxPurged", err)
	}
	cur, _ := inbox.ReadCursor(ctx, db.Pool, part)
	plan, err := inbox.PlanReplay(ctx, db.Pool, inbox.ReplayRequest{Partition: part, From: 10, KafkaFirst: 20, ReplayOptions: inbox.ReplayOptions{Reexecute: true}}, cur)
	if err != nil || plan.KafkaHolds != 80 || plan.Reexecute != 90 || plan.InboxApplied != 80 {
		t.Errorf("plan from 10 with Kafka holding 20.. = %+v, %v; want it accepted, 80 of 90 offsets in Kafka, 80 inbox rows", plan, err)
	}
	plan, err = inbox.PlanReplay(ctx, db.Pool, inbox.ReplayRequest{Partition: part, From: 10}, cur)
	if err != nil || plan.Reexecute != 0 {
		t.Errorf("idempotent plan from 10 = %+v, %v; want it accepted: the high-water mark skips the records", plan, err)
	}
	if _, err := replayIn(t, db, inbox.ReplayRequest{Partition: part, Token: 1, From: 20, ReplayOptions: inbox.ReplayOptions{Reexecute: true, Actor: "t", Reason: "r"}}); err != nil {
		t.Errorf("re-execution from the oldest row: %v", err)
	}
}

// --keep-event-ids keeps the generation, and with it the ids of the events
// the re-executed records emitted, as long as every record of the range
// last emitted under the current generation and none of its events is
// still waiting in the outbox.
func TestKeepEventIDs(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	handled100(t, db)
	keep := func(from, to int64) (inbox.ReplayResult, error) {
		return replayIn(t, db, inbox.ReplayRequest{Partition: part, Token: 1, From: from, ReplayOptions: inbox.ReplayOptions{To: to, Reexecute: true, KeepEventIDs: true, Actor: "t", Reason: "r"}})
	}
	catchUp := func() {
		t.Helper()
		cur, err := inbox.ReadCursor(ctx, db.Pool, part)
		if err != nil {
			t.Fatal(err)
		}
		err = inTx(t, db, func(tx pgx.Tx) error {
			if err := inbox.Advance(ctx, tx, part, 1, cur.NextOffset, 100); err != nil {
				return err
			}
			offsets := []int64{}
			for o := cur.NextOffset; o < 100; o++ {
				offsets = append(offsets, o)
			}
			_, err := inbox.Claim(ctx, tx, part, 1, inbox.Applied, offsets)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	res, err := keep(10, 20)
	if err != nil || res.Now.Generation != 0 || res.Plan.NewEventIDs() {
		t.Fatalf("keep at generation 0 = %+v, %v; want generation 0 kept", res, err)
	}
	catchUp()
	// An event of 30 waits in the outbox: the same id would collide with it.
	err = inTx(t, db, func(tx pgx.Tx) error {
		origin := outbox.Origin{Consumer: part.Consumer, Topic: part.Topic, Partition: part.Partition, Offset: 30,
			SourceID: outbox.SourceID(part.Topic, part.Partition, 30, "", 0)}
		return outbox.Insert(ctx, tx, []outbox.Row{outbox.NewRow(origin, 0, "k", outbox.Event{Subject: "x.y"})})
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := keep(25, 35); !errors.Is(err, inbox.ErrEventIDsNotKept) {
		t.Errorf("keep over an event still in the outbox: err = %v, want ErrEventIDsNotKept", err)
	}
	if _, err := db.Pool.Exec(ctx, `DELETE FROM kfn.outbox`); err != nil { // relayed
		t.Fatal(err)
	}
	// A re-execution with new ids of [50, 60): generation 1. Records 50..59
	// and 100.. emit under it; 60..99 were skipped and keep generation 0.
	res, err = replayIn(t, db, inbox.ReplayRequest{Partition: part, Token: 1, From: 50, ReplayOptions: inbox.ReplayOptions{To: 60, Reexecute: true, Actor: "t", Reason: "r"}})
	if err != nil || res.Now.Generation != 1 {
		t.Fatalf("re-execution with new ids = %+v, %v; want generation 1", res, err)
	}
	catchUp()
	for _, r := range [][2]int64{{40, 50}, {55, 65}, {65, 70}} {
		if _, err := keep(r[0], r[1]); !errors.Is(err, inbox.ErrEventIDsNotKept) {
			t.Errorf("keep over [%d, %d), not all under generation 1: err = %v, want ErrEventIDsNotKept", r[0], r[1], err)
		}
	}
	res, err = keep(52, 58)
	if err != nil || res.Now.Generation != 1 {
		t.Errorf("keep over [52, 58), all under generation 1 = %+v, %v; want generation 1 kept", res, err)
	}
	catchUp()
	// The kept re-execution did not change which records emitted under
	// generation 1.
	if _, err := keep(60, 70); !errors.Is(err, inbox.ErrEventIDsNotKept) {
		t.Errorf("keep over [60, 70) after a kept re-execution: err = %v, want ErrEventIDsNotKept", err)
	}
	var kept bool
	if err := db.Pool.QueryRow(ctx, `SELECT (details->>'keep_event_ids')::boolean FROM kfn.audit_log WHERE action = 'reexecute' ORDER BY id DESC LIMIT 1`).Scan(&kept); err != nil || !kept {
		t.Errorf("audit of the kept re-execution: keep_event_ids %v (%v), want true", kept, err)
	}
}
