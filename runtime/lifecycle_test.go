package runtime_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/effects"
)

func TestNewPartitionsArePickedUpWithoutARestart(t *testing.T) {
	b := setup(t, 2)
	fn := effects.Function(b.fn, b.topic)
	produced := b.produceN(t, 2, 10)
	w, stop := b.run(t, fn)
	b.waitCaughtUp(t, b.fn)

	client := &kafka.Client{Addr: kafka.TCP(b.kafka.Brokers...), Timeout: 10 * time.Second}
	resp, err := client.CreatePartitions(context.Background(), &kafka.CreatePartitionsRequest{
		Topics: []kafka.TopicPartitionsConfig{{Name: b.topic, Count: 4}},
	})
	if err != nil {
		t.Fatalf("add partitions: %v", err)
	}
	if err := resp.Errors[b.topic]; err != nil {
		t.Fatalf("add partitions: %v", err)
	}
	waitFor(t, 30*time.Second, "the new partitions to be writable", func() bool {
		return len(b.kafka.HighWatermarks(t, b.topic)) == 4
	})
	produced = append(produced, b.produce(t, 2, []byte("p2-a"), []byte("p2-b"))...)
	produced = append(produced, b.produce(t, 3, []byte("p3-a"))...)
	b.waitCaughtUp(t, b.fn)
	stop()
	wantDuplicates(t, w, 0, "picking up new partitions re-reads none of the old ones")
	if rep := b.check(t, b.fn, produced); rep.Applied != 23 {
		t.Errorf("applied %d, want 23 including the new partitions' records", rep.Applied)
	}
}

func TestInboxRetentionPurgesRowsButDedupStays(t *testing.T) {
	b := setup(t, 1)
	b.cfg.InboxRetention = time.Second
	fn := effects.Function(b.fn, b.topic)
	produced := b.produceN(t, 1, 50)
	w, stop := b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	waitFor(t, 20*time.Second, "the inbox rows to be purged", func() bool {
		var n int
		err := b.pg.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = $1`, b.fn).Scan(&n)
		return err == nil && n == 0
	})
	stop()
	wantDuplicates(t, w, 0, "the first delivery has nothing to skip")

	// Read everything again: the high-water mark alone must skip it all.
	execSQL(t, b, `UPDATE kfn.cursors SET next_offset = 0 WHERE consumer = $1`, b.fn)
	w, stop = b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	if got := w.Stats().Duplicates.Load(); got != 50 {
		t.Errorf("duplicates skipped after the purge = %d, want 50", got)
	}
	if rep := b.check(t, b.fn, produced); rep.Applied != 50 {
		t.Errorf("applied %d, want 50", rep.Applied)
	}
}

func TestDeadLetterRetentionPurgesOldDeadLetters(t *testing.T) {
	b := setup(t, 1)
	b.cfg.InboxRetention = time.Second // the retention loop then runs 4 times a second
	b.cfg.DeadLetterRetention = time.Hour
	b.cfg.WorkerID = "retention-worker"
	execSQL(t, b, `INSERT INTO kfn.dead_letters (consumer, topic, partition, "offset", reason, error, attempts, dead_at)
VALUES ($1, $2, 0, 1, 'permanent', 'old', 1, now() - interval '2 hours'), ($1, $2, 0, 2, 'permanent', 'new', 1, now())`, b.fn, b.topic)
	_, stop := b.run(t, effects.Function(b.fn, b.topic))
	defer stop()
	count := func(sql string) int {
		var n int
		if err := b.pg.Pool.QueryRow(context.Background(), sql, b.fn).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitFor(t, 20*time.Second, "the old dead letter to be purged", func() bool {
		return count(`SELECT count(*) FROM kfn.dead_letters WHERE consumer = $1 AND "offset" = 1`) == 0
	})
	if n := count(`SELECT count(*) FROM kfn.dead_letters WHERE consumer = $1 AND "offset" = 2`); n != 1 {
		t.Errorf("the new dead letter was purged too")
	}
	if n := count(`SELECT count(*) FROM kfn.audit_log WHERE action = 'purge' AND actor = 'retention-worker' AND details->>'count' = '1' AND $1 <> ''`); n != 1 {
		t.Errorf("%d purge audit rows by the worker with a count of 1, want 1", n)
	}
}

func TestMetricsExposeTheWorkersCounters(t *testing.T) {
	b := setup(t, 2)
	b.cfg.WorkerID = "metrics-worker"
	produced := b.produceN(t, 2, 15)
	w, stop := b.run(t, effects.Function(b.fn, b.topic))
	b.waitCaughtUp(t, b.fn)
	// The counters move once the worker has the COMMIT's reply, a moment
	// after the cursor moved in Postgres.
	waitFor(t, 5*time.Second, "the worker to count its commits", func() bool { return w.Stats().Applied.Load() == 30 })
	srv := httptest.NewServer(w.HTTPHandler())
	defer srv.Close()
	body := func(path string) string {
		t.Helper()
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		data, _ := io.ReadAll(resp.Body)
		return string(data)
	}
	metrics := body("/metrics")
	for _, want := range []string{
		`kfn_records_applied_total{function="` + b.fn + `",worker="` + b.cfg.WorkerID + `"} 30`,
		`kfn_partition_lag{function="` + b.fn + `",partition="1",source="` + b.topic + `",worker="` + b.cfg.WorkerID + `"} 0`,
		`kfn_records_dead_lettered_total{function="` + b.fn + `",reason="panic",worker="` + b.cfg.WorkerID + `"} 0`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if got := body("/healthz"); got != "ok\n" {
		t.Errorf("/healthz = %q", got)
	}
	stop()
	wantDuplicates(t, w, 0, "one run reads every record once")
	b.check(t, b.fn, produced)
}

// TestPostgresConnectionsDyingUnderLoad kills the worker's Postgres sessions
// again and again while it applies records, some of them in the middle of a
// COMMIT. Nothing may be lost or applied twice, and the worker must not
// mistake its own landed commit for a takeover and drop its partitions. The
// test counts the sessions it killed, and those it caught inside a
// transaction, and requires a minimum of each: a run where the worker's
// sessions were never there to kill proves nothing.
func TestPostgresConnectionsDyingUnderLoad(t *testing.T) {
	b := setup(t, 3)
	b.cfg.WorkerID = "victim"
	u, err := url.Parse(b.pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("application_name", "kfn-victim")
	u.RawQuery = q.Encode()
	b.cfg.DatabaseURL = u.String()
	b.cfg.BatchSize = 20 // many commits, so some die mid-COMMIT

	w, stop := b.run(t, effects.Function(b.fn, b.topic))
	var produced []effects.Produced
	var killed, inTx, rounds int64
	const minKilled, minInTx = 30, 5
	for round := 0; round < 60 && (round < 15 || killed < minKilled || inTx < minInTx); round++ {
		produced = append(produced, b.produceN(t, 3, 60)...)
		time.Sleep(time.Duration(20+round%15*7) * time.Millisecond)
		var k, x int64
		err := b.pg.Pool.QueryRow(context.Background(), `
SELECT count(pg_terminate_backend(pid)), count(*) FILTER (WHERE xact_start IS NOT NULL) FROM pg_stat_activity
 WHERE datname = current_database() AND application_name = 'kfn-victim'`).Scan(&k, &x)
		if err != nil {
			t.Fatal(err)
		}
		killed, inTx, rounds = killed+k, inTx+x, rounds+1
	}
	t.Logf("killed %d of the worker's sessions in %d rounds, %d of them inside a transaction", killed, rounds, inTx)
	if killed < minKilled || inTx < minInTx {
		t.Errorf("killed %d sessions, %d inside a transaction, in %d rounds; want at least %d and %d", killed, inTx, rounds, minKilled, minInTx)
	}
	b.waitCaughtUp(t, b.fn)
	stop()
	if rep := b.check(t, b.fn, produced); rep.Applied != len(produced) {
		t.Errorf("applied %d of %d", rep.Applied, len(produced))
	}
	// A commit whose reply was lost is recognised by the cursor being
	// ahead, and its records are dropped from the retry without a read:
	// nothing is skipped as a duplicate.
	wantDuplicates(t, w, 0, "a retried batch drops what its lost commit applied before it claims again")
	if n := w.Stats().Fenced.Load(); n != 0 {
		t.Errorf("the worker dropped %d partitions as fenced; nobody else owned them", n)
	}
}
