package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestMigrateDropWALOutboxWaitsForARelayThenDropsTheSlotOnce retires a
// WAL outbox holding events while no relay reads the slot: kfn migrate
// --drop-wal-outbox names what to start and exits 1 after --wait, keeping
// the retirement (kfn status shows it). With kfn relay started, a second
// run drains and drops it, every event reaches the stream once, and a
// third run finds nothing to do. --outbox wal with it is a usage error.
func TestMigrateDropWALOutboxWaitsForARelayThenDropsTheSlotOnce(t *testing.T) {
	db := kfntest.PostgresEmpty(t)
	ctx := context.Background()
	if code, out, stderr := kfn(t, "migrate", "--database-url", db.URL, "--outbox", "wal"); code != 0 {
		t.Fatalf("migrate --outbox wal: exit %d, out %q, err %q", code, out, stderr)
	}
	subject, stream := kfntest.Name(t, "ev")+".made", kfntest.Name(t, "EVENTS")
	var rows []outbox.Row
	for i := range 20 {
		rows = append(rows, outbox.NewRow(outbox.Origin{Consumer: "fn", Topic: "in", Offset: int64(i), SourceID: outbox.KafkaSourceID("in", 0, int64(i))}, 0, "k", outbox.Event{Subject: subject, Data: []byte{byte(i)}}))
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Write(ctx, tx, outbox.ModeWAL, rows) }); err != nil {
		t.Fatal(err)
	}

	if code, _, stderr := kfn(t, "migrate", "--database-url", db.URL, "--outbox", "wal", "--drop-wal-outbox"); code != 2 || !strings.Contains(stderr, "use one of them") || strings.Count(strings.TrimSpace(stderr), "\n") > 1 {
		t.Fatalf("--outbox wal --drop-wal-outbox: exit %d, err %q; want a one-line usage error", code, stderr)
	}
	if code, _, stderr := kfn(t, "migrate", "--database-url", db.URL, "--drop-wal-outbox", "--wait", "0s"); code != 2 || !strings.Contains(stderr, "--wait is 0s") {
		t.Fatalf("--wait 0s: exit %d, err %q; want a usage error", code, stderr)
	}
	code, out, stderr := kfn(t, "migrate", "--database-url", db.URL, "--drop-wal-outbox", "--wait", "2s")
	if code != 1 || !strings.Contains(out, "no relay reads the slot") || !strings.Contains(out, "start `kfn relay`") ||
		!strings.Contains(stderr, "the retirement is kept") || !strings.Contains(stderr, "run `kfn migrate --drop-wal-outbox` again") {
		t.Fatalf("--drop-wal-outbox without a relay: exit %d, out %q, err %q; want exit 1 naming kfn relay", code, out, stderr)
	}
	if code, out, stderr := kfn(t, "status", "--database-url", db.URL); code != 0 || !strings.Contains(out, "RETIRED since") || !strings.Contains(out, "left to relay") {
		t.Fatalf("status of the retired, undrained outbox: exit %d, out %q, err %q", code, out, stderr)
	}

	natsURL := kfntest.NATSURL(t)
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan struct{})
	var relayErr bytes.Buffer
	go func() {
		defer close(relayDone)
		var relayOut bytes.Buffer
		run(relayCtx, []string{"relay", "--database-url", db.URL, "--nats-url", natsURL, "--subjects", subject, "--event-stream", stream, "--lease-bucket", kfntest.Name(t, "leases")}, &relayOut, &relayErr)
	}()
	defer func() { stopRelay(); <-relayDone }()
	code, out, stderr = kfn(t, "migrate", "--database-url", db.URL, "--drop-wal-outbox", "--wait", "60s")
	if code != 0 || !strings.Contains(out, "drained") || !strings.Contains(out, "dropped; `kfn migrate --outbox wal` would set it up afresh") {
		t.Fatalf("--drop-wal-outbox with a relay: exit %d, out %q, err %q", code, out, stderr)
	}
	if st, err := outbox.ReadWALState(ctx, db.Pool); err != nil || st.SetUp {
		t.Fatalf("after the drop the WAL outbox reads %+v (%v); want not set up", st, err)
	}
	var slots int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE database = current_database()`).Scan(&slots); err != nil || slots != 0 {
		t.Fatalf("%d slots left (%v)", slots, err)
	}
	js := jetStreamAt(t, natsURL)
	requireRelayed(t, js, stream, rows)
	info, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	if n := info.CachedInfo().State.Msgs; n != uint64(len(rows)) {
		t.Fatalf("the stream holds %d messages, want %d", n, len(rows))
	}
	code, out, stderr = kfn(t, "migrate", "--database-url", db.URL, "--drop-wal-outbox")
	if code != 0 || !strings.Contains(out, "not set up in this database; nothing to drop") {
		t.Fatalf("a second --drop-wal-outbox: exit %d, out %q, err %q", code, out, stderr)
	}
	time.Sleep(time.Second)
	if strings.Contains(relayErr.String(), "slot is gone") || strings.Contains(relayErr.String(), `"level":"ERROR"`) {
		t.Errorf("the relay reported an error after the drop:\n%s", relayErr.String())
	}
}
