package inbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// writeAged dead-letters offset of part, dead-lettered age ago, with its
// inbox row.
func writeAged(t *testing.T, db *kfntest.PG, offset int64, age time.Duration) {
	t.Helper()
	ctx := context.Background()
	err := inTx(t, db, func(tx pgx.Tx) error {
		if err := inbox.MarkDeadLettered(ctx, tx, part, 1, offset); err != nil {
			return err
		}
		if _, err := inbox.WriteDeadLetter(ctx, tx, inbox.DeadLetter{Partition: part, Offset: offset, Reason: "permanent", Error: "bad", Attempts: 1}); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `UPDATE kfn.dead_letters SET dead_at = now() - $2::interval WHERE "offset" = $1`, offset, age)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// The worker's --dead-letter-retention runs this purge.
func TestPurgeDeadLettersDeletesTheOlderOnesAndAuditsTheCount(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	writeAged(t, db, 1, 31*24*time.Hour)
	writeAged(t, db, 2, 30*24*time.Hour+time.Minute)
	writeAged(t, db, 3, 30*24*time.Hour-time.Minute)
	writeAged(t, db, 4, time.Second)

	start := time.Now()
	before, n, err := inbox.PurgeDeadLetters(ctx, db.Pool, 30*24*time.Hour, "worker-1", "--dead-letter-retention 720h0m0s")
	if err != nil || n != 2 {
		t.Fatalf("PurgeDeadLetters = %d, %v; want the 2 older than 30 days", n, err)
	}
	if cut := start.Add(-30 * 24 * time.Hour); before.Before(cut.Add(-time.Minute)) || before.After(cut.Add(time.Minute)) {
		t.Errorf("cut-off %s, want about %s", before, cut)
	}
	left, err := inbox.FindDeadLetters(ctx, db.Pool, inbox.DeadLetterFilter{})
	if err != nil || len(left) != 2 || left[0].Offset != 3 || left[1].Offset != 4 {
		t.Errorf("left %+v, %v; want offsets 3 and 4", left, err)
	}
	var inboxRows int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.inbox WHERE outcome = 'dead_lettered'`).Scan(&inboxRows); err != nil || inboxRows != 4 {
		t.Errorf("dead_lettered inbox rows = %d, %v; want all 4 kept", inboxRows, err)
	}
	audit, err := inbox.ReadAudit(ctx, db.Pool, inbox.AuditFilter{Action: inbox.ActionPurge})
	if err != nil || len(audit) != 1 {
		t.Fatalf("purge audit rows = %+v, %v; want one", audit, err)
	}
	a := audit[0]
	if a.Actor != "worker-1" || a.Partition != (inbox.Partition{Partition: -1}) || !strings.Contains(string(a.Details), `"count": 2`) ||
		!strings.Contains(string(a.Details), `"reason": "--dead-letter-retention 720h0m0s"`) {
		t.Errorf("purge audit row = %+v (%s)", a, a.Details)
	}

	if _, n, err := inbox.PurgeDeadLetters(ctx, db.Pool, 30*24*time.Hour, "worker-1", "again"); err != nil || n != 0 {
		t.Errorf("second purge = %d, %v; want nothing", n, err)
	}
	if audit, _ := inbox.ReadAudit(ctx, db.Pool, inbox.AuditFilter{Action: inbox.ActionPurge}); len(audit) != 1 {
		t.Errorf("a purge that deleted nothing was audited: %+v", audit)
	}
	// More than one batch of them goes in one transaction, audited once.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO kfn.dead_letters (consumer, topic, partition, "offset", reason, error, attempts, dead_at)
SELECT 'fn', 'bulk', 0, o, 'permanent', 'bad', 1, now() - interval '40 days' FROM generate_series(1, 2500) AS o`); err != nil {
		t.Fatal(err)
	}
	if _, n, err := inbox.PurgeDeadLetters(ctx, db.Pool, 30*24*time.Hour, "worker-1", "bulk"); err != nil || n != 2500 {
		t.Errorf("bulk purge = %d, %v; want 2500", n, err)
	}
	if audit, _ := inbox.ReadAudit(ctx, db.Pool, inbox.AuditFilter{Action: inbox.ActionPurge}); len(audit) != 2 || !strings.Contains(string(audit[1].Details), `"count": 2500`) {
		t.Errorf("bulk purge audit rows = %+v; want one more, with the count", audit)
	}
	if _, _, err := inbox.PurgeDeadLetters(ctx, db.Pool, 0, "worker-1", "zero"); err == nil {
		t.Error("a purge of everything older than 0s was accepted")
	}
}

func TestDiscardDeadLettersKeepsTheInboxRows(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	for o := int64(1); o <= 3; o++ {
		writeAged(t, db, o, time.Duration(o)*time.Hour)
	}
	var gone []inbox.DeadLetter
	err := inTx(t, db, func(tx pgx.Tx) error {
		var err error
		gone, err = inbox.DiscardDeadLetters(ctx, tx, inbox.DeadLetterFilter{Since: time.Now().Add(-150 * time.Minute)}, "alice", "INC-1")
		return err
	})
	if err != nil || len(gone) != 2 || gone[0].Offset != 1 || gone[1].Offset != 2 {
		t.Fatalf("DiscardDeadLetters = %+v, %v; want offsets 1 and 2 (dead-lettered 1h and 2h ago)", gone, err)
	}
	if n, err := inbox.CountDeadLetters(ctx, db.Pool, inbox.DeadLetterFilter{}); err != nil || n != 1 {
		t.Errorf("dead letters left = %d, %v; want 1", n, err)
	}
	audit, err := inbox.ReadAudit(ctx, db.Pool, inbox.AuditFilter{Action: inbox.ActionDiscard})
	if err != nil || len(audit) != 2 || audit[0].Actor != "alice" || audit[0].Partition != part || !strings.Contains(string(audit[1].Details), `"offset": 2`) ||
		!strings.Contains(string(audit[1].Details), `"reason": "INC-1"`) {
		t.Errorf("discard audit rows = %+v, %v; want one per dead letter", audit, err)
	}
	var inboxRows int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.inbox WHERE outcome = 'dead_lettered'`).Scan(&inboxRows); err != nil || inboxRows != 3 {
		t.Errorf("dead_lettered inbox rows = %d, %v; want all 3 kept", inboxRows, err)
	}
	err = inTx(t, db, func(tx pgx.Tx) error {
		_, err := inbox.DiscardDeadLetters(ctx, tx, inbox.DeadLetterFilter{}, "alice", "")
		return err
	})
	if err == nil {
		t.Error("a discard without a reason was accepted")
	}
}
