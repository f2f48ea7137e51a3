package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// kfn status shows both kinds of lanes side by side: the partitions of a
// Kafka-triggered function (lag from Kafka's high watermark) and the lane
// of a NATS-triggered function (lag from its durable JetStream consumer:
// events not delivered yet plus delivered and not acked, and the ack
// floor), as a table and as JSON, with and without NATS or Kafka, and
// again and again with --watch.
func TestStatusShowsKafkaAndNATSLanes(t *testing.T) {
	db := kfntest.Postgres(t)
	k := kfntest.Kafka(t)
	natsURL := kfntest.NATSURL(t)
	bucket := kfntest.Name(t, "leases")
	topic := k.CreateTopic(t, 2)
	src, dst := kfntest.Name(t, "src"), kfntest.Name(t, "dst")
	subject, stream := src+".done", kfntest.Name(t, "events")
	table := pgx.Identifier{dst + "_seen"}.Sanitize()
	srcFn := runtime.Function{
		Name: src, Topic: topic, Emits: []string{subject},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			out.Emit(runtime.Event{Subject: subject, Data: rec.Value})
			return nil
		},
	}
	dstFn := runtime.Function{
		Name: dst, Subject: subject, Stream: stream,
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` (event_id text NOT NULL)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1)`, rec.EventID)
			return err
		},
	}
	cfg := operatorTestConfig(k, db.URL, natsURL, bucket)
	cfg.EventStream, cfg.BatchWait = stream, 5*time.Millisecond
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	_, stop := startWorker(t, cfg, srcFn, dstFn)
	nc, js, err := connect.NATS(natsURL, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx := context.Background()
	count := func(sql string, args ...any) int {
		var n int
		if err := db.Pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	consumerIdle := func() bool {
		c, err := js.Consumer(ctx, stream, dst)
		if err != nil {
			return false
		}
		info, err := c.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0
	}
	base := []string{"status", "--database-url", db.URL}
	withKafka := []string{"--kafka-brokers", strings.Join(k.Brokers, ",")}
	withNATS := []string{"--nats-url", natsURL, "--lease-bucket", bucket}
	statusJSON := func(args ...string) []operator.PartitionStatus {
		t.Helper()
		code, out, stderr := kfn(t, append(append(cloneArgs(base), args...), "--json")...)
		var parts []operator.PartitionStatus
		if code != 0 || json.Unmarshal([]byte(out), &parts) != nil {
			t.Fatalf("kfn status %v --json: exit %d, out %q, err %q", args, code, out, stderr)
		}
		return parts
	}

	// The NATS lane before it handled any event: its claim recorded its
	// lane count (kfn.subject_lanes), which tells it from a Kafka
	// partition, with NATS or without.
	waitFor(t, "the NATS lane claimed and its consumer created", func() bool {
		_, err := js.Consumer(ctx, stream, dst)
		return err == nil && count(`SELECT count(*) FROM kfn.cursors WHERE consumer = $1`, dst) == 1
	})
	parts := statusJSON(append(cloneArgs(withKafka), withNATS...)...)
	if lane := find(parts, dst, 0); lane.Kind != operator.KindSubject || lane.Stream != stream || lane.Lag != 0 || lane.Problem != "" {
		t.Errorf("NATS lane before any event = %+v; want kind nats on stream %s, lag 0", lane, stream)
	}
	code, out, stderr := kfn(t, append(cloneArgs(base), withKafka...)...)
	t.Logf("$ kfn status (Kafka only, the NATS lane idle)\n%s", out)
	if code != 0 || !regexp.MustCompile(`(?m)^`+dst+` +nats +`+regexp.QuoteMeta(subject)+` +0 `).MatchString(out) || strings.Contains(out, "Kafka has no topic") {
		t.Errorf("status without NATS before the NATS lane handled anything: exit %d, out %q, err %q; want its lane 0 as kind nats, and Kafka not asked about it", code, out, stderr)
	}

	msgs := make([]kafka.Message, 6)
	for i := range msgs {
		msgs[i] = kafka.Message{Partition: i % 2, Value: []byte(fmt.Sprintf("v%d", i))}
	}
	k.Produce(t, topic, msgs...)
	waitFor(t, "6 events handled downstream", func() bool { return count(`SELECT count(*) FROM `+table) == 6 && consumerIdle() })
	waitFor(t, "the Kafka cursors at the end", func() bool {
		return count(`SELECT count(*) FROM kfn.cursors WHERE consumer = $1 AND next_offset = 3`, src) == 2
	})
	parts = statusJSON(append(cloneArgs(withKafka), withNATS...)...)
	if len(parts) != 3 {
		t.Fatalf("status lists %d lanes, want 2 partitions and a NATS lane: %+v", len(parts), parts)
	}
	for _, p := range []int32{0, 1} {
		if lane := find(parts, src, p); lane.Kind != operator.KindKafka || lane.KafkaHighMark != 3 || lane.Lag != 0 || lane.LeaseHolder != "worker-1" || lane.Pending != nil {
			t.Errorf("Kafka lane %d = %+v; want kind kafka, high watermark 3, lag 0, held by worker-1", p, lane)
		}
	}
	lane := find(parts, dst, 0)
	if lane.Kind != operator.KindSubject || lane.Topic != subject || lane.KafkaHighMark != -1 || lane.Lag != 0 || lane.LeaseHolder != "worker-1" ||
		lane.Pending == nil || *lane.Pending != 0 || *lane.AckPending != 0 || *lane.AckFloor != 6 || lane.Cursor != 7 {
		t.Errorf("NATS lane = %+v; want kind nats on %s, lag 0, nothing pending, ack floor 6, cursor 7, held by worker-1", lane, subject)
	}

	// Stopped, with 2 records waiting in Kafka and 3 events in JetStream.
	stop()
	k.Produce(t, topic, kafka.Message{Partition: 0, Value: []byte("late")}, kafka.Message{Partition: 0, Value: []byte("later")})
	for i := 0; i < 3; i++ {
		m := nats.NewMsg(subject)
		m.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("direct-%d", i))
		if _, err := js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	parts = statusJSON(append(cloneArgs(withKafka), withNATS...)...)
	if l := find(parts, src, 0); l.Lag != 2 || l.LeaseHolder != "" {
		t.Errorf("Kafka lane 0 while stopped = %+v; want lag 2 and no lease holder", l)
	}
	if l := find(parts, dst, 0); l.Lag != 3 || *l.Pending != 3 || *l.AckFloor != 6 {
		t.Errorf("NATS lane while stopped = %+v; want lag 3 (3 pending), ack floor 6", l)
	}
	code, out, stderr = kfn(t, append(append(cloneArgs(base), withKafka...), withNATS...)...)
	t.Logf("$ kfn status\n%s", out)
	header := regexp.MustCompile(`(?m)^FUNCTION +KIND +TOPIC / SUBJECT +PARTITION +OWNER +EPOCH +LEASE +CURSOR +KAFKA HIGH +ACK FLOOR +LAG +LAST COMMIT$`)
	natsRow := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(dst) + ` +nats +` + regexp.QuoteMeta(subject) + ` +0 +worker-1 +\d+ +free +7 +- +6 +3 +\S+ ago$`)
	kafkaRow := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(src) + ` +kafka +` + regexp.QuoteMeta(topic) + ` +0 +worker-1 +\d+ +free +3 +5 +- +2 +\S+ ago$`)
	if code != 0 || !header.MatchString(out) || !natsRow.MatchString(out) || !kafkaRow.MatchString(out) || strings.Contains(out, "note:") {
		t.Errorf("status table: exit %d, err %q:\n%s", code, stderr, out)
	}
	// Without NATS the handled events still tell the NATS lane apart.
	parts = statusJSON(withKafka...)
	if l := find(parts, dst, 0); l.Kind != operator.KindSubject || l.Lag != -1 || l.Problem != "" {
		t.Errorf("NATS lane without --nats-url = %+v; want kind nats, lag unknown, no problem", l)
	}
	code, out, _ = kfn(t, append(cloneArgs(base), withKafka...)...)
	if code != 0 || !strings.Contains(out, "(LEASE and the NATS lanes' ACK FLOOR and LAG need --nats-url)") || !natsRowNoNATS(dst, subject).MatchString(out) {
		t.Errorf("status table without NATS: exit %d:\n%s", code, out)
	}
	// Without Kafka: the Kafka lanes' lag is unknown.
	parts = statusJSON(withNATS...)
	if l := find(parts, src, 0); l.Lag != -1 || l.KafkaHighMark != -1 {
		t.Errorf("Kafka lane without --kafka-brokers = %+v; want lag and high watermark unknown", l)
	}

	// --watch prints the table again and again until Ctrl-C, and clears
	// the screen only on a terminal (not here).
	var wout, werr bytes.Buffer
	wctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancel()
	code = run(wctx, append(append(append(cloneArgs(base), withKafka...), withNATS...), "--watch", "400ms"), &wout, &werr)
	if n := header.FindAllStringIndex(wout.String(), -1); code != 0 || len(n) < 3 || strings.Contains(wout.String(), "\033") ||
		strings.Count(wout.String(), "kfn status every 400ms, at ") != len(n) {
		t.Errorf("--watch 400ms for 1.5s: exit %d, %d tables, err %q:\n%q", code, len(n), werr.String(), wout.String())
	}
	wctx, cancel = context.WithTimeout(ctx, 1100*time.Millisecond)
	defer cancel()
	wout.Reset()
	code = run(wctx, append(append(append(cloneArgs(base), withNATS...), "--json"), "--watch", "400ms"), &wout, &werr)
	dec := json.NewDecoder(&wout)
	docs := 0
	for {
		var parts []operator.PartitionStatus
		if err := dec.Decode(&parts); err != nil {
			break
		}
		if len(parts) == 3 {
			docs++
		}
	}
	if code != 0 || docs < 2 {
		t.Errorf("--watch --json: exit %d, %d JSON documents of 3 lanes, err %q", code, docs, werr.String())
	}

	// kfn replay refuses a NATS lane: its cursor is not an offset.
	code, _, stderr = kfn(t, "replay", "--database-url", db.URL, "--nats-url", natsURL, "--lease-bucket", bucket, "--kafka-brokers", strings.Join(k.Brokers, ","),
		"--function", dst, "--topic", subject, "--from-offset", "0")
	if code != 1 || !strings.Contains(stderr, "consumes the NATS subject "+subject+", not a Kafka topic") {
		t.Errorf("replay of a NATS lane: exit %d, stderr %q; want a refusal", code, stderr)
	}
}

func natsRowNoNATS(dst, subject string) *regexp.Regexp {
	return regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(dst) + ` +nats +` + regexp.QuoteMeta(subject) + ` +0 +worker-1 +\d+ +\? +7 +- +\? +\? +\S+ ago$`)
}

func find(parts []operator.PartitionStatus, function string, partition int32) operator.PartitionStatus {
	for _, p := range parts {
		if p.Function == function && p.Partition == partition {
			return p
		}
	}
	return operator.PartitionStatus{}
}

// cloneArgs returns a copy of s, so that appending to it leaves s alone.
func cloneArgs(s []string) []string { return append([]string(nil), s...) }

// kfn status shows a partition's key-lanes (KeyConcurrency > 1): each
// one's progress, how far the furthest got past the cursor, and the
// key-lanes the cursor waits on: those not past it, one of which holds the
// record at the cursor (a key-lane commits its records in order).
func TestStatusShowsKeyLanesAndWhatTheCursorWaitsOn(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	fn, topic := kfntest.Name(t, "fn"), kfntest.Name(t, "topic")
	for _, sql := range []string{
		`INSERT INTO kfn.cursors (consumer, topic, partition, next_offset, high_water, epoch, owner) VALUES ($1, $2, 0, 100, 100, 7, 'w1')`,
		`INSERT INTO kfn.key_lanes (consumer, topic, partition, lane, lanes, epoch, next_offset)
SELECT $1, $2, 0, l, 4, 7, (ARRAY[100, 130, 90, 120])[l + 1] FROM generate_series(0, 3) AS l`,
	} {
		if _, err := db.Pool.Exec(ctx, sql, fn, topic); err != nil {
			t.Fatal(err)
		}
	}
	code, out, stderr := kfn(t, "status", "--database-url", db.URL, "--function", fn, "--json")
	var parts []operator.PartitionStatus
	if code != 0 || json.Unmarshal([]byte(out), &parts) != nil || len(parts) != 1 {
		t.Fatalf("kfn status --json: exit %d, out %q, err %q", code, out, stderr)
	}
	if p := parts[0]; len(p.KeyLanes) != 4 || p.Ahead != 30 || fmt.Sprint(p.WaitsOn) != "[0 2]" {
		t.Errorf("status = %+v; want 4 key-lanes, 30 ahead of the cursor, waiting on key-lanes [0 2]", p)
	}
	code, out, stderr = kfn(t, "status", "--database-url", db.URL, "--function", fn)
	t.Logf("$ kfn status\n%s", out)
	want := fmt.Sprintf("key-lanes of %s/%s/0 (key-lane:next offset): 0:100 1:130 2:90 3:120; committed up to 30 past the cursor; the cursor waits on key-lane 0 or 2", fn, topic)
	if code != 0 || !strings.Contains(out, want) {
		t.Errorf("kfn status: exit %d, err %q, out %q; want the line %q", code, stderr, out, want)
	}
}
