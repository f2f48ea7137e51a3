package bench

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// The pipeline (wal) mode's walsender starts decoding at the slot's
// restart_lsn. skipWAL, run between modes, must leave both it and the
// confirmed position at the WAL's end: moving only the confirmed position
// (pg_replication_slot_advance) left restart_lsn where the last standby
// snapshot was, and the next round's walsender first decoded the earlier
// modes' WAL, 240 MB and 2.9 s of a 2-s round. The WAL outbox stays set
// up and usable (not lost), with no event of before in the slot.
func TestSkipWALLeavesTheSlotNothingToDecode(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	if _, err := outbox.SetUpWAL(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	// WAL the slot has not read, as an earlier mode writes it: rows, and events.
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE filler AS SELECT g, repeat('x', 200) AS pad FROM generate_series(1, 20000) g`); err != nil {
		t.Fatal(err)
	}
	rows := []outbox.Row{outbox.NewRow(outbox.Origin{Consumer: "orders", Topic: "orders", SourceID: "orders/0/1"}, 0, "k", outbox.Event{Subject: "orders.accepted"})}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Write(ctx, tx, outbox.ModeWAL, rows) }); err != nil {
		t.Fatal(err)
	}
	var end string
	if err := db.Pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&end); err != nil {
		t.Fatal(err)
	}
	if err := skipWAL(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	var restart, confirmed string
	var restartPast, confirmedPast bool
	err := db.Pool.QueryRow(ctx, `
SELECT s.restart_lsn::text, s.confirmed_flush_lsn::text, s.restart_lsn >= $1::pg_lsn, s.confirmed_flush_lsn >= $1::pg_lsn
  FROM pg_replication_slots s JOIN kfn.wal_outbox w USING (slot_name)`, end).Scan(&restart, &confirmed, &restartPast, &confirmedPast)
	if err != nil {
		t.Fatal(err)
	}
	if !restartPast || !confirmedPast {
		t.Errorf("after skipWAL the slot restarts decoding at %s and is confirmed up to %s; want both at or past the WAL's end before it, %s", restart, confirmed, end)
	}
	if err := outbox.CheckWAL(ctx, db.Pool); err != nil {
		t.Errorf("after skipWAL the WAL outbox is not usable: %v", err)
	}
	var pending int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_logical_slot_peek_binary_changes((SELECT slot_name FROM kfn.wal_outbox), NULL, NULL, 'proto_version', '1', 'publication_names', 'kfn_outbox', 'messages', 'true')`).Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if pending != 0 {
		t.Errorf("after skipWAL the slot still holds %d messages", pending)
	}
}
