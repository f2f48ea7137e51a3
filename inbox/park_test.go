package inbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestParkDeadLettersOneUnhandledRecordAndIsAudited(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	if _, err := inbox.ClaimPartition(ctx, db.Pool, part, 1, "w", 10); err != nil { // cursor and high water at 10
		t.Fatal(err)
	}
	park := func(token, offset int64, record *inbox.DeadLetter) (inbox.ParkResult, error) {
		var res inbox.ParkResult
		err := inTx(t, db, func(tx pgx.Tx) (err error) {
			res, err = inbox.Park(ctx, tx, inbox.ParkRequest{Partition: part, Token: token, Offset: offset, Record: record, Actor: "ops", Reason: "INC-1"})
			return err
		})
		return res, err
	}
	stuck := &inbox.DeadLetter{Key: []byte{0, 1, 2}, Value: []byte("poison\x00")}
	res, err := park(1, 10, stuck)
	if err != nil || res.Previous.NextOffset != 10 || res.Now.NextOffset != 11 || res.Now.HighWater != 11 {
		t.Fatalf("park at the cursor = %+v, %v; want the cursor moved 10 -> 11", res, err)
	}
	if res, err := park(1, 15, nil); err != nil || res.Now.NextOffset != 11 {
		t.Fatalf("park ahead of the cursor = %+v, %v; want the cursor left at 11", res, err)
	}
	var fresh []int64
	err = inTx(t, db, func(tx pgx.Tx) (err error) {
		fresh, err = inbox.Claim(ctx, tx, part, 1, inbox.Applied, []int64{11, 12, 13, 14, 15, 16})
		return err
	})
	if err != nil || len(fresh) != 5 || fresh[4] != 16 {
		t.Errorf("the lane's claim of 11..16 found fresh %v (%v); want 15 skipped as handled", fresh, err)
	}
	for _, tc := range []struct {
		token, offset int64
		want          error
	}{
		{1, 10, inbox.ErrAlreadyHandled}, // below the high-water mark
		{1, 15, inbox.ErrAlreadyHandled}, // parked already
		{1, 16, inbox.ErrAlreadyHandled}, // claimed by the lane above
		{2, 20, inbox.ErrFenced},         // not the partition's holder
	} {
		if _, err := park(tc.token, tc.offset, nil); !errors.Is(err, tc.want) {
			t.Errorf("park offset %d with token %d: err = %v, want %v", tc.offset, tc.token, err, tc.want)
		}
	}
	dead, err := inbox.ListDeadLetters(ctx, db.Pool, part.Consumer, 10)
	if err != nil || len(dead) != 2 {
		t.Fatalf("dead letters = %+v, %v; want the two parked records", dead, err)
	}
	if d := dead[0]; d.Offset != 10 || d.Reason != inbox.ReasonParked || string(d.Key) != "\x00\x01\x02" || string(d.Value) != "poison\x00" || d.Error != "parked by ops: INC-1" {
		t.Errorf("dead letter of the record read = %+v; want its bytes, reason parked and the operator's reason", d)
	}
	if d := dead[1]; d.Offset != 15 || d.Key != nil || d.Value != nil {
		t.Errorf("dead letter of the record not read = %+v; want coordinates only", d)
	}
	var audits int
	err = db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.audit_log WHERE action = 'park' AND actor = 'ops' AND details->>'reason' = 'INC-1'`).Scan(&audits)
	if err != nil || audits != 2 {
		t.Errorf("audit log has %d park entries (%v), want 2", audits, err)
	}
}
