package main

import (
	"context"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestMigrateOutboxWALCreatesTheSlotThenFindsItThenRecreatesALostOne runs
// kfn migrate --outbox wal three times: it creates the slot and the
// publication, then finds them, then, after the slot was dropped, creates
// it again and warns that events were lost, with the way to recover them.
// kfn status shows the slot, then says loudly that it is lost.
func TestMigrateOutboxWALCreatesTheSlotThenFindsItThenRecreatesALostOne(t *testing.T) {
	db := kfntest.PostgresEmpty(t)
	code, out, stderr := kfn(t, "migrate", "--database-url", db.URL, "--outbox", "wal")
	if code != 0 || !strings.Contains(out, "replication slot kfn_outbox_") || !strings.Contains(out, " created, publication kfn_outbox created") {
		t.Fatalf("first migrate --outbox wal: exit %d, out %q, err %q", code, out, stderr)
	}
	code, out, stderr = kfn(t, "migrate", "--database-url", db.URL, "--outbox", "wal")
	if code != 0 || !strings.Contains(out, " present, publication kfn_outbox present") || strings.Contains(out, "WARNING") {
		t.Fatalf("second migrate --outbox wal: exit %d, out %q, err %q", code, out, stderr)
	}
	code, out, stderr = kfn(t, "status", "--database-url", db.URL)
	if code != 0 || !strings.Contains(out, "WAL outbox: slot kfn_outbox_") || !strings.Contains(out, "no relay reads it; holds ") {
		t.Fatalf("status with the WAL outbox set up: exit %d, out %q, err %q", code, out, stderr)
	}
	if _, err := db.Pool.Exec(context.Background(), `SELECT pg_drop_replication_slot(slot_name) FROM kfn.wal_outbox`); err != nil {
		t.Fatal(err)
	}
	code, out, stderr = kfn(t, "status", "--database-url", db.URL)
	if code != 0 || !strings.Contains(out, "is LOST") || !strings.Contains(out, "kfn migrate --outbox wal") {
		t.Fatalf("status with the slot dropped: exit %d, out %q, err %q", code, out, stderr)
	}
	code, out, stderr = kfn(t, "migrate", "--database-url", db.URL, "--outbox", "wal")
	if code != 0 || !strings.Contains(out, "WARNING: the slot had been lost") || !strings.Contains(out, "--reexecute --keep-event-ids") {
		t.Fatalf("migrate --outbox wal after the slot was dropped: exit %d, out %q, err %q", code, out, stderr)
	}
	code, _, stderr = kfn(t, "migrate", "--database-url", db.URL, "--outbox", "disk")
	if code != 2 || !strings.Contains(stderr, "--outbox (KFN_OUTBOX)") || !strings.Contains(stderr, "use table or wal") {
		t.Errorf("migrate --outbox disk: exit %d, err %q; want a usage error naming the flag", code, stderr)
	}
}
