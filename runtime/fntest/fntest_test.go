package fntest_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/fntest"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

// calls counts the handler's calls per offset, across attempts.
type calls map[int64]int

// misbehaving writes a row and emits one event per record, and misbehaves
// as the record's value says.
func misbehaving(c calls) runtime.Function {
	return runtime.Function{
		Name: "misbehaving", Topic: "t", Emits: []string{"done"},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS rows_written ("offset" bigint)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			c[rec.Offset]++
			if _, err := tx.Exec(ctx, `INSERT INTO rows_written VALUES ($1)`, rec.Offset); err != nil {
				return err
			}
			switch v := string(rec.Value); {
			case v == "permanent":
				return runtime.Permanent(errors.New("cannot be applied"))
			case v == "panic":
				panic("handler bug")
			case v == "always":
				return errors.New("transient, forever")
			case strings.HasPrefix(v, "fail-"):
				var n int
				fmt.Sscanf(v, "fail-%d", &n)
				if rec.Attempt <= n {
					return fmt.Errorf("transient, attempt %d", rec.Attempt)
				}
			case v == "undeclared":
				out.Emit(runtime.Event{Subject: "elsewhere", Data: rec.Value})
				return nil
			}
			out.Emit(runtime.Event{Subject: "done", Data: rec.Value})
			return nil
		},
	}
}

func TestApplyReportsWhatTheWorkerWouldDo(t *testing.T) {
	pg := kfntest.PostgresEmpty(t)
	ctx := context.Background()
	tx, err := pg.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck

	c := calls{}
	fn := fntest.New(misbehaving(c))
	fn.RetryAttempts = 3
	if err := fn.Setup(ctx, tx); err != nil {
		t.Fatal(err)
	}
	rec := func(offset int64, value string) runtime.Record {
		return runtime.Record{Topic: "t", Offset: offset, Key: []byte("k"), Value: []byte(value)}
	}
	res, err := fn.Apply(ctx, tx, rec(0, "ok"), rec(1, "permanent"), rec(2, "panic"), rec(3, "fail-2"), rec(4, "always"), rec(5, "undeclared"), rec(0, "ok"))
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		outcome  fntest.Outcome
		reason   string
		attempts int
		events   int
	}{
		{fntest.Applied, "", 1, 1},
		{fntest.DeadLettered, "permanent", 1, 0},
		{fntest.DeadLettered, "panic", 3, 0},
		{fntest.Applied, "", 3, 1},
		{fntest.DeadLettered, "handler_error", 3, 0},
		{fntest.DeadLettered, "permanent", 1, 0}, // an event outside Emits
		{fntest.Duplicate, "", 0, 0},
	}
	for i, w := range want {
		r := res[i]
		if r.Outcome != w.outcome || r.Reason != w.reason || r.Attempts != w.attempts || len(r.Events) != w.events {
			t.Errorf("record %d (%s): outcome %s, reason %q, attempts %d, %d events (err %v); want %s, %q, %d, %d",
				i, r.Record.Value, r.Outcome, r.Reason, r.Attempts, len(r.Events), r.Err, w.outcome, w.reason, w.attempts, w.events)
		}
	}
	if ev := res[0].Events[0]; ev.Subject != "done" || string(ev.Key) != "k" || ev.Type != "done" || string(ev.Data) != "ok" {
		t.Errorf("event of record 0 = %+v, want subject done, key k (the record's), type done, data ok", ev)
	}
	if c[0] != 1 {
		t.Errorf("the duplicate called the handler again: %d calls for offset 0", c[0])
	}
	// Only the attempts that succeeded left their writes.
	var offsets []int64
	rows, err := tx.Query(ctx, `SELECT "offset" FROM rows_written ORDER BY 1`)
	if err == nil {
		offsets, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	}
	if err != nil || fmt.Sprint(offsets) != "[0 3]" {
		t.Errorf("rows written = %v (%v), want [0 3]: a failed attempt's writes must be rolled back", offsets, err)
	}
}

func TestEventsCanBeMadeForADirectCall(t *testing.T) {
	rec := runtime.Record{Topic: "t", Offset: 7, Value: []byte("x")}
	out := runtime.NewEvents(rec)
	handler := func(_ context.Context, _ pgx.Tx, rec runtime.Record, out *runtime.Events) error {
		out.Emit(runtime.Event{Subject: "a", Data: rec.Value})
		out.Emit(runtime.Event{Subject: "b"})
		return nil
	}
	if err := handler(context.Background(), nil, rec, out); err != nil {
		t.Fatal(err)
	}
	if got := out.Emitted(); len(got) != 2 || got[0].Subject != "a" || got[1].Subject != "b" {
		t.Errorf("Emitted() = %+v, want the events a and b in order", got)
	}
	var zero runtime.Events // usable without a worker too
	zero.Emit(runtime.Event{Subject: "z"})
	if len(zero.Emitted()) != 1 {
		t.Error("a zero Events lost its event")
	}
}

// With KeyOrder ParkKey, a dead-lettered record parks the later records of
// its key on its partition; other keys, other partitions and records
// without a key are applied.
func TestApplyParksTheKeyOfADeadLetteredRecord(t *testing.T) {
	pg := kfntest.PostgresEmpty(t)
	ctx := context.Background()
	tx, err := pg.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	c := calls{}
	f := misbehaving(c)
	f.KeyOrder = runtime.ParkKey
	fn := fntest.New(f)
	if err := fn.Setup(ctx, tx); err != nil {
		t.Fatal(err)
	}
	rec := func(partition int32, offset int64, key, value string) runtime.Record {
		r := runtime.Record{Topic: "t", Partition: partition, Offset: offset, Value: []byte(value)}
		if key != "" {
			r.Key = []byte(key)
		}
		return r
	}
	res, err := fn.Apply(ctx, tx, rec(0, 0, "a", "ok"), rec(0, 1, "a", "permanent"), rec(0, 2, "b", "ok"), rec(0, 3, "a", "ok"),
		rec(1, 0, "a", "ok"), rec(0, 4, "", "permanent"), rec(0, 5, "", "ok"))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range res {
		got = append(got, string(r.Outcome)+"/"+r.Reason)
	}
	want := "applied/ dead_lettered/permanent applied/ dead_lettered/key_parked applied/ dead_lettered/permanent applied/"
	if strings.Join(got, " ") != want {
		t.Errorf("outcomes = %v; want %s", got, want)
	}
	if c[3] != 0 || !strings.Contains(fmt.Sprint(res[3].Err), "offset 1") {
		t.Errorf("the parked record: %d handler calls, err %v; want none, and its error naming offset 1", c[3], res[3].Err)
	}
}
