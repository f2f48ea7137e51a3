package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// A record whose handler ends its own Postgres session looks like an
// infrastructure failure on every try, so kfn retries it forever and the
// partition stands still: the kind of stall no one foresaw. `kfn dlq park`
// gets the partition going, and the dead letter holds the record's bytes.
func TestDLQParkMovesAPartitionPastARecordThatStallsIt(t *testing.T) {
	db := kfntest.Postgres(t)
	k := kfntest.Kafka(t)
	natsURL := kfntest.NATSURL(t)
	bucket := kfntest.Name(t, "leases")
	topic := k.CreateTopic(t, 1)
	name := kfntest.Name(t, "stall")
	table := pgx.Identifier{name + "_applied"}.Sanitize()
	fn := runtime.Function{
		Name: name, Topic: topic,
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` ("offset" bigint NOT NULL)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, _ *runtime.Events) error {
			if string(rec.Value) == "end-my-session" {
				_, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` ("offset") VALUES ($1)`, rec.Offset)
			return err
		},
	}
	msgs := []kafka.Message{{Value: []byte("a")}, {Value: []byte("b")},
		{Key: []byte{0, 0xff}, Value: []byte("end-my-session"), Headers: []kafka.Header{{Key: "h", Value: []byte("v")}}},
		{Value: []byte("c")}, {Value: []byte("d")}}
	k.Produce(t, topic, msgs...)

	ctx := context.Background()
	w, _ := startWorker(t, operatorTestConfig(k, db.URL, natsURL, bucket), fn)
	cursor := func() int64 {
		var next int64
		if err := db.Pool.QueryRow(ctx, `SELECT coalesce(max(next_offset), -1) FROM kfn.cursors WHERE consumer = $1`, name).Scan(&next); err != nil {
			t.Fatal(err)
		}
		return next
	}
	// The whole first batch (offsets 0..4) is retried as one: the session
	// died inside it, and nothing tells kfn the record is to blame.
	var committed int64
	deadline := time.Now().Add(30 * time.Second)
	for committed = w.Stats().Batches.Load(); cursor() < 0 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(3 * time.Second) // several retries
	if got := cursor(); got != 0 || w.Stats().Batches.Load() != committed {
		t.Fatalf("cursor = %d; want it held at 0 by the record that ends its session", got)
	}

	status := []string{"status", "--database-url", db.URL, "--kafka-brokers", strings.Join(k.Brokers, ","), "--nats-url", natsURL,
		"--lease-bucket", bucket, "--function", name}
	code, out, stderr := kfn(t, append(status, "--json")...)
	var parts []operator.PartitionStatus
	if code != 0 || json.Unmarshal([]byte(out), &parts) != nil || len(parts) != 1 || parts[0].Cursor != 0 || parts[0].Lag != 5 {
		t.Errorf("status during the stall: exit %d, out %q, err %q; want cursor 0 and lag 5", code, out, stderr)
	}
	_, out, _ = kfn(t, status...)
	t.Logf("$ kfn status\n%s", out)

	base := []string{"dlq", "park", "--database-url", db.URL, "--nats-url", natsURL, "--lease-bucket", bucket,
		"--function", name, "--topic", topic, "--partition", "0"}
	code, _, stderr = kfn(t, append(base, "--offset", "2")...)
	if code != 2 || !strings.Contains(stderr, "--reason is required") {
		t.Errorf("park without a reason: exit %d, stderr %q; want a usage error", code, stderr)
	}
	code, out, stderr = kfn(t, append(base, "--offset", "2", "--reason", "INC-7: ends its session", "--kafka-brokers", strings.Join(k.Brokers, ","))...)
	if code != 0 || !strings.Contains(out, "dead-lettered as parked, with the record's key, value and headers; cursor 0 -> 0") {
		t.Fatalf("park: exit %d, out %q, err %q", code, out, stderr)
	}
	t.Logf("$ kfn dlq park\n%s", out)
	parkedAt := time.Now()
	for cursor() != 5 && time.Since(parkedAt) < 30*time.Second {
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("the partition reached its end %v after the park", time.Since(parkedAt).Round(time.Millisecond))
	if got := cursor(); got != 5 {
		t.Fatalf("cursor = %d after the park; want 5", got)
	}
	rows, err := db.Pool.Query(ctx, `SELECT "offset" FROM `+table+` ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	applied, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(applied) != 4 || applied[0] != 0 || applied[1] != 1 || applied[2] != 3 || applied[3] != 4 {
		t.Errorf("applied offsets = %v (%v); want 0, 1, 3, 4 once each", applied, err)
	}

	code, out, _ = kfn(t, "dlq", "--database-url", db.URL, "--function", name)
	t.Logf("$ kfn dlq\n%s", out)
	if code != 0 || !strings.Contains(out, "parked") || !strings.Contains(out, "parked by kfn-dlq-park:") || !strings.Contains(out, "INC-7") {
		t.Errorf("dlq list: exit %d, out %q; want the parked record with the operator's reason", code, out)
	}
	var key, value []byte
	if err := db.Pool.QueryRow(ctx, `SELECT record_key, value FROM kfn.dead_letters WHERE consumer = $1 AND "offset" = 2`, name).Scan(&key, &value); err != nil ||
		string(key) != "\x00\xff" || string(value) != "end-my-session" {
		t.Errorf("dead letter bytes = %q, %q (%v); want the record's key and value", key, value, err)
	}
	code, _, stderr = kfn(t, append(base, "--offset", "2", "--reason", "again")...)
	if code != 1 || !strings.Contains(stderr, "already applied or dead-lettered") {
		t.Errorf("parking it again: exit %d, stderr %q; want a refusal", code, stderr)
	}
}
