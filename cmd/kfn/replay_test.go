package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// replayRig is a Kafka-triggered function that records every application
// of a record in its own table and emits one event per record, with a
// worker that can be stopped and started again.
type replayRig struct {
	db              *kfntest.PG
	kafka           *kfntest.KafkaCluster
	natsURL, bucket string
	topic, name     string
	subject, stream string
	table           string
	cfg             runtime.Config
	fn              runtime.Function
	stop            func()
	js              jetstream.JetStream
}

func newReplayRig(t *testing.T, partitions int, leaseTTL time.Duration) *replayRig {
	t.Helper()
	r := &replayRig{db: kfntest.Postgres(t), kafka: kfntest.Kafka(t), natsURL: kfntest.NATSURL(t), bucket: kfntest.Name(t, "leases")}
	r.topic = r.kafka.CreateTopic(t, partitions)
	r.name = kfntest.Name(t, "tally")
	r.subject, r.stream = r.name+".applied", kfntest.Name(t, "events")
	r.table = pgx.Identifier{r.name + "_applied"}.Sanitize()
	r.cfg = runtime.Config{
		KafkaBrokers: r.kafka.Brokers, DatabaseURL: r.db.URL, NATSURL: r.natsURL, WorkerID: "worker-1",
		LeaseTTL: leaseTTL, LeaseRenew: 500 * time.Millisecond, LeaseBucket: r.bucket, EventStream: r.stream,
		BatchSize: 100, BatchWait: 5 * time.Millisecond, RetryAttempts: 2, RetryInitial: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})),
	}
	r.fn = runtime.Function{
		Name: r.name, Topic: r.topic, Emits: []string{r.subject},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+r.table+` (partition int NOT NULL, "offset" bigint NOT NULL)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			if string(rec.Value) == "bad" {
				return runtime.Permanent(errors.New("bad record"))
			}
			if _, err := tx.Exec(ctx, `INSERT INTO `+r.table+` VALUES ($1, $2)`, rec.Partition, rec.Offset); err != nil {
				return err
			}
			out.Emit(runtime.Event{Subject: r.subject, Data: rec.Value})
			return nil
		},
	}
	nc, js, err := connect.NATS(r.natsURL, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	r.js = js
	return r
}

// start runs a worker for the function until stop or the end of the test.
func (r *replayRig) start(t *testing.T) {
	t.Helper()
	w, err := worker.New(context.Background(), r.cfg, r.fn)
	if err != nil {
		t.Fatal(err)
	}
	r.stop = kfntest.Background(t, "worker", w.Run)
}

// produce writes values to partition p.
func (r *replayRig) produce(t *testing.T, p int, values ...string) {
	t.Helper()
	msgs := make([]kafka.Message, len(values))
	for i, v := range values {
		msgs[i] = kafka.Message{Partition: p, Key: []byte(fmt.Sprintf("k%d", i)), Value: []byte(v)}
	}
	r.kafka.Produce(t, r.topic, msgs...)
}

// cmd returns the kfn command line for this rig: the command, the shared
// settings, --function and --topic, then args.
func (r *replayRig) cmd(command string, args ...string) []string {
	out := []string{command, "--database-url", r.db.URL, "--nats-url", r.natsURL, "--lease-bucket", r.bucket,
		"--kafka-brokers", strings.Join(r.kafka.Brokers, ","), "--function", r.name, "--topic", r.topic}
	return append(out, args...)
}

func (r *replayRig) cursor(t *testing.T, p int32) inbox.Cursor {
	t.Helper()
	c, err := inbox.ReadCursor(context.Background(), r.db.Pool, inbox.Partition{Consumer: r.name, Topic: r.topic, Partition: p})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// waitCursor waits until partition p's cursor is at want.
func (r *replayRig) waitCursor(t *testing.T, p int32, want int64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var next int64
		err := r.db.Pool.QueryRow(context.Background(), `SELECT next_offset FROM kfn.cursors WHERE consumer = $1 AND topic = $2 AND partition = $3`,
			r.name, r.topic, p).Scan(&next)
		if err == nil && next == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("cursor of partition %d did not reach %d (at %d, %v)", p, want, next, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitRelayed waits until the outbox is empty: every event is in the stream.
func (r *replayRig) waitRelayed(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := r.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kfn.outbox`).Scan(&n); err == nil && n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the outbox still holds %d events after 30s", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// applied counts the applications of each offset of partition p.
func (r *replayRig) applied(t *testing.T, p int32) map[int64]int {
	t.Helper()
	rows, err := r.db.Pool.Query(context.Background(), `SELECT "offset", count(*) FROM `+r.table+` WHERE partition = $1 GROUP BY 1`, p)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int64]int{}
	var o int64
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&o, &n}, func() error { out[o] = n; return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// streamMessages counts the events of the function's subject in its stream.
func (r *replayRig) streamMessages(t *testing.T) uint64 {
	t.Helper()
	s, err := r.js.Stream(context.Background(), r.stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background(), jetstream.WithSubjectFilter(r.subject))
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}

// epochs reads the epoch of every cursor of the function.
func (r *replayRig) epochs(t *testing.T) map[int32]int64 {
	t.Helper()
	rows, err := r.db.Pool.Query(context.Background(), `SELECT partition, epoch FROM kfn.cursors WHERE consumer = $1`, r.name)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int32]int64{}
	var p int32
	var e int64
	if _, err := pgx.ForEachRow(rows, []any{&p, &e}, func() error { out[p] = e; return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// dumpDatabase returns every row of every kfn table, of the function's
// table and the kfn sequences' positions, as COPY text in a fixed order.
func (r *replayRig) dumpDatabase(t *testing.T) string {
	t.Helper()
	ctx := context.Background()
	conn, err := r.db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	rows, err := conn.Query(ctx, `SELECT format('%I.%I', schemaname, tablename) FROM pg_tables WHERE schemaname = 'kfn' ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(tables) < 8 {
		t.Fatalf("kfn tables = %v (%v)", tables, err)
	}
	tables = append(tables, r.table)
	var out bytes.Buffer
	for _, table := range tables {
		fmt.Fprintf(&out, "== %s\n", table)
		if _, err := conn.Conn().PgConn().CopyTo(ctx, &out, `COPY (SELECT * FROM `+table+` t ORDER BY t::text) TO STDOUT`); err != nil {
			t.Fatalf("dump %s: %v", table, err)
		}
	}
	fmt.Fprintf(&out, "== sequences\n")
	if _, err := conn.Conn().PgConn().CopyTo(ctx, &out,
		`COPY (SELECT schemaname, sequencename, last_value FROM pg_sequences WHERE schemaname = 'kfn' ORDER BY 1, 2) TO STDOUT`); err != nil {
		t.Fatal(err)
	}
	return out.String()
}

// bucketState is the lease bucket's stream position: any write, delete or
// expiry in it moves it.
func (r *replayRig) bucketState(t *testing.T) string {
	t.Helper()
	s, err := r.js.Stream(context.Background(), "KV_"+r.bucket)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("last seq %d, msgs %d, bytes %d", info.State.LastSeq, info.State.Msgs, info.State.Bytes)
}

// A dry run prints what a replay would do and changes nothing: every kfn
// table, the function's table and the lease bucket are the same, byte for
// byte, before and after dry runs of an idempotent replay, a re-execution
// and a re-execution keeping its event ids. The re-execution it described
// then does exactly that: records [5, 10) applied again, [10, 20) not, and
// with --keep-event-ids no new event reaches the stream.
func TestReplayDryRunChangesNothingAndDescribesTheReplay(t *testing.T) {
	// A lease TTL far longer than the test: no lease expires (and writes an
	// expiry marker into the bucket) while it compares the bucket.
	r := newReplayRig(t, 2, 20*time.Second)
	values := make([]string, 20)
	for i := range values {
		values[i] = fmt.Sprintf("v%d", i)
	}
	values[7] = "bad"
	r.produce(t, 0, values...)
	r.produce(t, 1, values[:12]...)
	r.start(t)
	r.waitCursor(t, 0, 20)
	r.waitCursor(t, 1, 12)
	r.waitRelayed(t)
	r.stop()
	events := r.streamMessages(t)
	if events != 19+11 {
		t.Fatalf("the stream holds %d events, want 30", events)
	}

	dbBefore, bucketBefore := r.dumpDatabase(t), r.bucketState(t)
	code, out, stderr := kfn(t, r.cmd("replay", "--partition", "0", "--from-offset", "5", "--dry-run")...)
	if code != 0 {
		t.Fatalf("dry run: exit %d, %s", code, stderr)
	}
	t.Logf("$ kfn replay --partition 0 --from-offset 5 --dry-run\n%s", out)
	for _, want := range []string{"dry run of an idempotent replay: nothing was changed", "/0: cursor 20 -> 5",
		"range:           [5, 20): 15 offsets", "already handled: 15 (below the high-water mark 20); inbox rows: 14 applied, 1 dead-lettered",
		"to re-execute:   0: the records are read again and skipped"} {
		if !strings.Contains(out, want) {
			t.Errorf("dry run output lacks %q:\n%s", want, out)
		}
	}
	code, out, stderr = kfn(t, r.cmd("replay", "--from-offset", "5", "--to-offset", "10", "--reexecute", "--reason", "INC-9", "--dry-run")...)
	if code != 0 {
		t.Fatalf("dry run of a re-execution: exit %d, %s", code, stderr)
	}
	t.Logf("$ kfn replay --from-offset 5 --to-offset 10 --reexecute --reason INC-9 --dry-run\n%s", out)
	for _, want := range []string{"dry run of a re-execution: nothing was changed", "/0: cursor 20 -> 5", "/1: cursor 12 -> 5",
		"range:           [5, 10): 5 offsets", "already handled: 5 (below the high-water mark 20); inbox rows: 4 applied, 1 dead-lettered",
		"to re-execute:   5: inbox rows of [5, 10) released, the high-water mark drops to 5",
		"stays handled:   10: [10, 20) keep their inbox rows and are skipped",
		"stays handled:   2: [10, 12) keep their inbox rows and are skipped",
		"NEW ids (generation 0 -> 1): downstream functions apply them again"} {
		if !strings.Contains(out, want) {
			t.Errorf("dry run output lacks %q:\n%s", want, out)
		}
	}
	code, out, stderr = kfn(t, r.cmd("replay", "--partition", "0", "--from-offset", "5", "--to-offset", "10", "--reexecute", "--reason", "INC-9", "--keep-event-ids", "--dry-run")...)
	if code != 0 || !strings.Contains(out, "ORIGINAL event ids (generation 0 kept)") {
		t.Fatalf("dry run keeping event ids: exit %d, out %q, err %q", code, out, stderr)
	}
	if dbAfter := r.dumpDatabase(t); dbAfter != dbBefore {
		t.Errorf("the dry runs changed the database:\nbefore:\n%s\nafter:\n%s", dbBefore, dbAfter)
	}
	if bucketAfter := r.bucketState(t); bucketAfter != bucketBefore {
		t.Errorf("the dry runs changed the lease bucket: %s, then %s", bucketBefore, bucketAfter)
	}

	// Now for real, with the worker running.
	r.start(t)
	code, out, stderr = kfn(t, r.cmd("replay", "--partition", "0", "--from-offset", "5", "--to-offset", "10", "--reexecute", "--reason", "INC-9",
		"--keep-event-ids", "--wait", "--wait-timeout", "60s")...)
	t.Logf("$ kfn replay --partition 0 --from-offset 5 --to-offset 10 --reexecute --reason INC-9 --keep-event-ids --wait\n%s", out)
	if code != 0 || !strings.Contains(out, "cursor 20 -> 5 (re-execution: 5 inbox rows released, records [5, 10) will be applied again, their events keep their original ids (generation 0); [10, 20) stays handled)") ||
		!regexp.MustCompile(`the workers reached the end of the replay in 1 partition\(s\) after `).MatchString(out) || strings.Contains(out, "\r") {
		t.Fatalf("re-execution: exit %d, out %q, err %q; want it done, waited for, and no progress line off a terminal", code, out, stderr)
	}
	r.waitCursor(t, 0, 20)
	applied := r.applied(t, 0)
	for o := int64(0); o < 20; o++ {
		want := 1
		switch {
		case o == 7:
			want = 0 // dead-lettered, again
		case o >= 5 && o < 10:
			want = 2
		}
		if applied[o] != want {
			t.Errorf("offset %d applied %d times, want %d", o, applied[o], want)
		}
	}
	r.waitRelayed(t)
	if got := r.streamMessages(t); got != events {
		t.Errorf("the stream holds %d events after a re-execution keeping the ids, want still %d (JetStream dropped the repeats)", got, events)
	}
	if c := r.cursor(t, 0); c.Generation != 0 || c.HighWater != 20 {
		t.Errorf("cursor after the re-execution = %+v; want generation 0 and the high-water mark back at 20", c)
	}
	// The same with new ids: downstream gets 4 more events.
	code, out, stderr = kfn(t, r.cmd("replay", "--partition", "0", "--from-offset", "5", "--to-offset", "10", "--reexecute", "--reason", "INC-10", "--wait", "--wait-timeout", "60s")...)
	if code != 0 || !strings.Contains(out, "their events get new ids (generation 1)") {
		t.Fatalf("re-execution with new ids: exit %d, out %q, err %q", code, out, stderr)
	}
	r.waitRelayed(t)
	if got := r.streamMessages(t); got != events+4 {
		t.Errorf("the stream holds %d events after a re-execution with new ids, want %d", got, events+4)
	}
	if n := r.applied(t, 1); len(n) != 11 || n[5] != 1 {
		t.Errorf("partition 1 was touched: %v", n)
	}
}

// Every refusal happens before any lease is taken: the epochs in
// kfn.cursors, the lease bucket and the audit log stay as they were.
func TestReplayRefusesBadArgumentsBeforeTakingALease(t *testing.T) {
	r := newReplayRig(t, 2, 20*time.Second)
	values := make([]string, 10)
	for i := range values {
		values[i] = fmt.Sprintf("v%d", i)
	}
	r.produce(t, 0, values...)
	r.produce(t, 1, values[:4]...)
	r.start(t)
	r.waitCursor(t, 0, 10)
	r.waitCursor(t, 1, 4)
	r.waitRelayed(t)
	r.stop()
	ctx := context.Background()
	// Retention purged the inbox rows of partition 1 below 2.
	if _, err := r.db.Pool.Exec(ctx, `DELETE FROM kfn.inbox WHERE lane IN (SELECT id FROM kfn.lanes WHERE consumer = $1 AND partition = 1) AND "offset" < 2`, r.name); err != nil {
		t.Fatal(err)
	}
	audit := func() int {
		var n int
		if err := r.db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.audit_log`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	epochs, bucket, audits := r.epochs(t), r.bucketState(t), audit()
	future := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
	cases := []struct {
		name string
		args []string
		code int
		want string
	}{
		{"unknown function", []string{"replay", "--database-url", r.db.URL, "--nats-url", r.natsURL, "--lease-bucket", r.bucket,
			"--kafka-brokers", strings.Join(r.kafka.Brokers, ","), "--function", "nope", "--topic", r.topic, "--from-offset", "0"},
			2, `function "nope" has no cursor on topic`},
		{"unknown topic", []string{"replay", "--database-url", r.db.URL, "--nats-url", r.natsURL, "--lease-bucket", r.bucket,
			"--kafka-brokers", strings.Join(r.kafka.Brokers, ","), "--function", r.name, "--topic", "nope", "--from-offset", "0"},
			2, `has no cursor on topic "nope"`},
		{"unknown partition", r.cmd("replay", "--partition", "5", "--from-offset", "0"), 2, "has no cursor on partition [5] (it has on [0 1])"},
		{"from past the high-water mark", r.cmd("replay", "--partition", "0", "--from-offset", "11"), 1, "offset 11 is past the high watermark 10"},
		{"from past the high-water mark of one partition", r.cmd("replay", "--from-offset", "6"), 1, "offset 6 is past the high watermark 4"},
		{"to before from", r.cmd("replay", "--partition", "0", "--from-offset", "5", "--to-offset", "3", "--reexecute", "--reason", "x"), 1, "--to-offset 3 is not after the from offset 5"},
		{"to past the high-water mark", r.cmd("replay", "--partition", "1", "--from-offset", "2", "--to-offset", "9", "--reexecute", "--reason", "x"), 1, "--to-offset 9 is past the high watermark 4"},
		{"a time in the future", r.cmd("replay", "--from-time", future), 1, "is in the future"},
		{"a re-execution over purged inbox rows", r.cmd("replay", "--from-offset", "0", "--reexecute", "--reason", "x"), 1,
			"the oldest inbox row of " + r.name + "/" + r.topic + "/1 is at offset 2, so the rows of [0, 2) were purged by retention"},
		{"an offset and a time", r.cmd("replay", "--from-offset", "0", "--from-time", "2026-01-01T00:00:00Z"), 2, "exclude each other"},
		{"a time that is not RFC3339", r.cmd("replay", "--from-time", "yesterday"), 2, `--from-time "yesterday": neither an RFC 3339 time`},
		{"keep event ids without re-execution", r.cmd("replay", "--from-offset", "0", "--keep-event-ids"), 2, "--keep-event-ids is a choice of a re-execution"},
		{"no Kafka", []string{"replay", "--database-url", r.db.URL, "--nats-url", r.natsURL, "--function", r.name, "--topic", r.topic, "--from-offset", "0"},
			2, "--kafka-brokers is required"},
	}
	for _, tc := range cases {
		code, out, stderr := kfn(t, tc.args...)
		if code != tc.code || !strings.Contains(stderr, tc.want) {
			t.Errorf("%s: exit %d, stderr %q, out %q; want exit %d and %q", tc.name, code, stderr, out, tc.code, tc.want)
		}
		if got := r.epochs(t); fmt.Sprint(got) != fmt.Sprint(epochs) {
			t.Errorf("%s: epochs %v, were %v", tc.name, got, epochs)
		}
	}
	if got := r.bucketState(t); got != bucket {
		t.Errorf("the refusals changed the lease bucket: %s, then %s", bucket, got)
	}
	if got := audit(); got != audits {
		t.Errorf("the refusals wrote %d audit rows", got-audits)
	}
	code, out, stderr := kfn(t, r.cmd("replay", "--from-offset", "0", "--reexecute", "--reason", "x")...)
	t.Logf("$ kfn replay --from-offset 0 --reexecute --reason x\n%s%s", out, stderr)
	// The same re-execution from 2 is accepted for both partitions.
	code, out, stderr = kfn(t, r.cmd("replay", "--from-offset", "2", "--reexecute", "--reason", "x")...)
	if code != 0 || strings.Count(out, "re-execution:") != 2 {
		t.Errorf("re-execution from 2: exit %d, out %q, err %q; want both partitions", code, out, stderr)
	}
}

// --from-time resolves, in each partition, to the first record whose
// timestamp is at or after it (Kafka's offsets-for-times). A partition
// whose cursor is there already, or with no record that recent, is left
// alone.
func TestReplayFromTimePicksTheOffsetsKafkaGives(t *testing.T) {
	r := newReplayRig(t, 2, 2*time.Second)
	base := time.Now().Add(-30 * time.Minute).Truncate(time.Second).UTC()
	var p0, p1 []kafka.Message
	for i := 0; i < 10; i++ { // partition 0: one record every 10 s
		p0 = append(p0, kafka.Message{Partition: 0, Value: []byte(fmt.Sprintf("a%d", i)), Time: base.Add(time.Duration(i) * 10 * time.Second)})
	}
	for i := 0; i < 4; i++ { // partition 1: one record every minute
		p1 = append(p1, kafka.Message{Partition: 1, Value: []byte(fmt.Sprintf("b%d", i)), Time: base.Add(time.Duration(i) * time.Minute)})
	}
	r.kafka.Produce(t, r.topic, p0...)
	r.kafka.Produce(t, r.topic, p1...)
	r.start(t)
	r.waitCursor(t, 0, 10)
	r.waitCursor(t, 1, 4)

	cases := []struct {
		at         time.Time
		p0, p1     string
		p0At, p1At int64
	}{
		{base.Add(25 * time.Second), "cursor 10 -> 3", "cursor 4 -> 1", 3, 1},                               // between records: the next one
		{base.Add(30 * time.Second), "cursor 10 -> 3", "cursor 4 -> 1", 3, 1},                               // exactly a record's time: that record
		{base.Add(-time.Hour), "cursor 10 -> 0", "cursor 4 -> 0", 0, 0},                                     // before everything: the first record
		{base.Add(95 * time.Second), "nothing to replay: no record is at or after", "cursor 4 -> 2", 10, 2}, // after partition 0's last record
	}
	for _, tc := range cases {
		code, out, stderr := kfn(t, r.cmd("replay", "--from-time", tc.at.Format(time.RFC3339), "--dry-run")...)
		t.Logf("$ kfn replay --from-time %s --dry-run\n%s", tc.at.Format(time.RFC3339), out)
		if code != 0 || !strings.Contains(out, "/0: "+tc.p0) || !strings.Contains(out, "/1: "+tc.p1) {
			t.Errorf("--from-time %s: exit %d, out %q, err %q; want partition 0 %q and partition 1 %q", tc.at.Format(time.RFC3339), code, out, stderr, tc.p0, tc.p1)
		}
	}
	epochs := r.epochs(t)
	code, out, stderr := kfn(t, r.cmd("replay", "--from-time", base.Add(95*time.Second).Format(time.RFC3339))...)
	t.Logf("$ kfn replay --from-time %s\n%s", base.Add(95*time.Second).Format(time.RFC3339), out)
	if code != 0 || !strings.Contains(out, "/0: left alone: no record is at or after") || !strings.Contains(out, "/1: cursor 4 -> 2 [--from-time") {
		t.Fatalf("replay from a time: exit %d, out %q, err %q", code, out, stderr)
	}
	if got := r.epochs(t); got[0] != epochs[0] || got[1] <= epochs[1] {
		t.Errorf("epochs %v, were %v: want partition 0 left alone, partition 1 seized", got, epochs)
	}
	r.waitCursor(t, 1, 4)
	if n := r.applied(t, 1); len(n) != 4 || n[2] != 1 || n[3] != 1 {
		t.Errorf("partition 1 after an idempotent replay from offset 2: applications %v, want each record once", n)
	}
}

func TestProgressLine(t *testing.T) {
	got := progressLine([]int32{0}, map[int32]int64{0: 1200}, map[int32]int64{0: 5000}, 1000, 3800, 3800, 2*time.Second)
	if want := "cursor 1200 -> 5000, 1000/3800 records, 500 records/s, ETA 8s"; got != want {
		t.Errorf("progressLine = %q, want %q", got, want)
	}
	got = progressLine([]int32{0, 1}, map[int32]int64{0: 10, 1: 3}, map[int32]int64{0: 10, 1: 9}, 0, 12, 6, time.Second)
	if want := "1/2 partitions done, 0/12 records, 0 records/s, ETA ?"; got != want {
		t.Errorf("progressLine = %q, want %q", got, want)
	}
}
