package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

// kfn runs the CLI in-process and returns its exit code and output.
func kfn(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	code = run(ctx, args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// waitFor polls cond every 20 ms for up to 30 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// startWorker starts a worker running fns and stops it when the test
// ends (or when stop is called).
func startWorker(t *testing.T, cfg runtime.Config, fns ...runtime.Function) (w *worker.Worker, stop func()) {
	t.Helper()
	w, err := worker.New(context.Background(), cfg, fns...)
	if err != nil {
		t.Fatal(err)
	}
	return w, kfntest.Background(t, "worker", w.Run)
}

// operatorTestConfig is the worker the operator-command tests run: 2 s
// leases renewed every 500 ms, so a test's takeovers are quick.
func operatorTestConfig(k *kfntest.KafkaCluster, databaseURL, natsURL, bucket string) runtime.Config {
	return runtime.Config{
		KafkaBrokers: k.Brokers, DatabaseURL: databaseURL, NATSURL: natsURL, WorkerID: "worker-1",
		LeaseTTL: 2 * time.Second, LeaseRenew: 500 * time.Millisecond, LeaseBucket: bucket,
	}
}

func TestBadInvocationsExitWithUsageErrors(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{nil, "usage: kfn <command>"},
		{[]string{"deploy"}, `unknown command "deploy"`},
		{[]string{"migrate", "--no-such-flag"}, "unknown flag --no-such-flag"},
		{[]string{"migrate", "--database-url", "postgres://x@y/z", "extra"}, `unexpected argument "extra"`},
		{[]string{"status", "--database-url", ""}, "--database-url is required"},
		{[]string{"console", "--database-url", "postgres://x@y/z", "--trust-proxy-header", "X-User", "--client-address-header", "X-Real-IP"}, "--client-address-header is for the login form of --auth-file"},
		{[]string{"replay", "--database-url", "postgres://x@y/z", "--nats-url", "nats://n", "--function", "f", "--topic", "t", "--partition", "0"}, "--from-offset is required"},
		{[]string{"replay", "--database-url", "postgres://x@y/z", "--nats-url", "nats://n", "--function", "f", "--topic", "t", "--partition", "0", "--from-offset", "0", "--reexecute"}, "say why with --reason"},
		{[]string{"dev", "--rate", "0"}, "--rate 0 is out of range"},
		{[]string{"bench", "--records", "10", "--naive-records", "20"}, "--naive-records (20) <= --records (10)"},
		{[]string{"bench", "--rounds", "0"}, "--rounds 0 is out of range"},
		{[]string{"bench", "--relay-duration", "0s"}, "--relay-events and --relay-duration must be positive"},
		{[]string{"bench", "--cpuprofile-mode", "wal"}, `--cpuprofile-mode "wal" is not a mode: name one of copy limit, wal limit, exactly-once`},
		{[]string{"dlq", "--database-url", "postgres://x@y/z", "--limit", "0"}, "--limit must be at least 1"},
		{[]string{"migrate", "--database-url", "postgres://x@y/z", "--nats"}, "--nats-url is required (or set KFN_NATS_URL)"},
		{[]string{"tail", "orders.accepted", "--nats-url", "nats://127.0.0.1:1", "--nats-ca", "/nonexistent/ca.pem"}, "--nats-ca (KFN_NATS_CA): cannot read the CA file"},
		{[]string{"migrate", "--database-url", "postgres://x@y/z", "--nats", "--nats-url", "nats://n"}, "--nats needs --subjects (KFN_RELAY_SUBJECTS)"},
	}
	for _, tc := range cases {
		code, _, stderr := kfn(t, tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("kfn %q = exit %d, stderr %q; want exit 2 and %q", tc.args, code, stderr, tc.want)
		}
	}
}

func TestUnreachableDatabaseIsAClearError(t *testing.T) {
	code, _, stderr := kfn(t, "migrate", "--database-url", "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=2")
	if code != 1 || !strings.Contains(stderr, "cannot reach Postgres at postgres://postgres@127.0.0.1:1/postgres") {
		t.Errorf("exit %d, stderr %q; want exit 1 naming the unreachable database", code, stderr)
	}
}

func TestMigrateAppliesOnceThenReportsUpToDate(t *testing.T) {
	db := kfntest.PostgresEmpty(t)
	var versions []int
	for _, m := range schema.Migrations() {
		versions = append(versions, m.Version)
	}
	code, out, stderr := kfn(t, "migrate", "--database-url", db.URL)
	if code != 0 || !strings.Contains(out, fmt.Sprintf("applied migrations %v", versions)) ||
		!strings.Contains(out, fmt.Sprintf("workers built for schema version %d or later run against it", schema.OldestCompatible())) {
		t.Fatalf("first migrate: exit %d, out %q, err %q", code, out, stderr)
	}
	code, out, _ = kfn(t, "migrate", "--database-url", db.URL)
	if code != 0 || !strings.Contains(out, "schema is up to date") {
		t.Errorf("second migrate: exit %d, out %q", code, out)
	}
}

// TestOperatorCommandsAgainstARunningWorker runs the orders function, then
// drives status, dlq and replay (idempotent and re-execution) as an operator
// would, and checks what each did to the data.
func TestOperatorCommandsAgainstARunningWorker(t *testing.T) {
	db := kfntest.Postgres(t)
	k := kfntest.Kafka(t)
	natsURL := kfntest.NATSURL(t)
	bucket := kfntest.Name(t, "leases") // its own bucket: its lease TTL differs from other tests'
	topic := k.CreateTopic(t, 1)
	fn := orders.Function()
	fn.Name, fn.Topic = kfntest.Name(t, "orders"), topic

	var msgs []kafka.Message
	for i := 1; i <= 20; i++ {
		key, value := validOrder(i)
		msgs = append(msgs, kafka.Message{Partition: 0, Key: []byte(key), Value: value})
	}
	msgs = append(msgs, kafka.Message{Partition: 0, Key: []byte("bad"), Value: []byte("{not json")})
	k.Produce(t, topic, msgs...)

	ctx := context.Background()
	startWorker(t, operatorTestConfig(k, db.URL, natsURL, bucket), fn)
	waitCursor := func(want int64) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			var next int64
			err := db.Pool.QueryRow(ctx, `SELECT next_offset FROM kfn.cursors WHERE consumer = $1`, fn.Name).Scan(&next)
			if err == nil && next == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("cursor did not reach %d (at %d, %v)", want, next, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitCursor(21)

	code, out, stderr := kfn(t, "status", "--database-url", db.URL, "--kafka-brokers", strings.Join(k.Brokers, ","), "--nats-url", natsURL, "--lease-bucket", bucket, "--function", fn.Name, "--json")
	var parts []operator.PartitionStatus
	if code != 0 || json.Unmarshal([]byte(out), &parts) != nil || len(parts) != 1 {
		t.Fatalf("status: exit %d, out %q, err %q", code, out, stderr)
	}
	if p := parts[0]; p.Cursor != 21 || p.KafkaHighMark != 21 || p.Lag != 0 || p.LeaseHolder != "worker-1" || p.Owner != "worker-1" || p.Epoch != int64(p.LeaseToken) {
		t.Errorf("status = %+v; want cursor 21, high watermark 21, lag 0, worker-1 holding the lease whose token is the epoch", p)
	}

	code, out, _ = kfn(t, "dlq", "--database-url", db.URL, "--function", fn.Name)
	if code != 0 || !strings.Contains(out, "permanent") || !strings.Contains(out, "decode orders.Order JSON") || strings.Count(out, "\n") != 2 {
		t.Errorf("dlq: exit %d, out %q; want one dead letter with its reason and error", code, out)
	}

	revisions := func() (rows, total int64) {
		t.Helper()
		if err := db.Pool.QueryRow(ctx, `SELECT count(*), coalesce(sum(revisions), 0) FROM orders`).Scan(&rows, &total); err != nil {
			t.Fatal(err)
		}
		return rows, total
	}
	replay := []string{"replay", "--database-url", db.URL, "--nats-url", natsURL, "--lease-bucket", bucket, "--kafka-brokers", strings.Join(k.Brokers, ","),
		"--function", fn.Name, "--topic", topic, "--partition", "0", "--from-offset", "5"}
	code, out, stderr = kfn(t, replay...)
	if code != 0 || !strings.Contains(out, "cursor 21 -> 5 (idempotent") {
		t.Fatalf("replay: exit %d, out %q, err %q", code, out, stderr)
	}
	waitCursor(21)
	if rows, total := revisions(); rows != 20 || total != 20 {
		t.Errorf("after an idempotent replay: %d orders with %d revisions, want 20 and 20", rows, total)
	}

	code, out, stderr = kfn(t, append(replay, "--reexecute", "--reason", "test: re-apply after a fix")...)
	if code != 0 || !strings.Contains(out, "re-execution: 16 inbox rows released") {
		t.Fatalf("re-execution: exit %d, out %q, err %q", code, out, stderr)
	}
	waitCursor(21)
	deadline := time.Now().Add(30 * time.Second)
	for _, total := revisions(); total != 35 && time.Now().Before(deadline); _, total = revisions() {
		time.Sleep(20 * time.Millisecond)
	}
	if rows, total := revisions(); rows != 20 || total != 35 {
		t.Errorf("after re-executing offsets 5..19: %d orders with %d revisions, want 20 and 35", rows, total)
	}
	var audit int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.audit_log WHERE consumer = $1 AND action IN ('replay', 'reexecute')`, fn.Name).Scan(&audit); err != nil || audit != 2 {
		t.Errorf("audit log has %d replay entries (%v), want 2", audit, err)
	}
}

func TestDevProcessesItsSampleTrafficEndToEnd(t *testing.T) {
	db := kfntest.Postgres(t)
	code, out, stderr := kfn(t, "dev", "--duration", "6s", "--rate", "300", "--database-url", db.URL)
	if code != 0 {
		t.Fatalf("kfn dev: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, stderr)
	}
	for _, want := range []string{"kafka     embedded broker", "replaying orders/orders/0", "verify: OK"} {
		if !strings.Contains(out, want) {
			t.Errorf("kfn dev output lacks %q:\n%s", want, out)
		}
	}
	progress := regexp.MustCompile(`produced +(\d+) +processed +\d+ +duplicates skipped +(\d+) +dead-lettered +(\d+)`)
	var produced, duplicates, deadLettered int
	for _, m := range progress.FindAllStringSubmatch(out, -1) {
		produced, _ = strconv.Atoi(m[1])
		duplicates, _ = strconv.Atoi(m[2])
		deadLettered, _ = strconv.Atoi(m[3])
	}
	if produced < 1000 || deadLettered == 0 || duplicates == 0 {
		t.Errorf("last progress line: produced %d, dead-lettered %d, duplicates skipped %d; want traffic, dead letters and the replay's skipped duplicates", produced, deadLettered, duplicates)
	}
}

// TestDevStopsCleanlyOnSIGTERM: kfn dev stopped with SIGTERM (as a
// service manager or CI stops it; Ctrl-C's SIGINT takes the same path)
// drains, verifies and exits 0.
func TestDevStopsCleanlyOnSIGTERM(t *testing.T) {
	bin := kfntest.BuildBinary(t, "github.com/kfn-dev/kfn/cmd/kfn")
	db := kfntest.Postgres(t)
	p := kfntest.StartProcess(t, exec.Command(bin, "dev", "--database-url", db.URL))
	deadline := time.Now().Add(60 * time.Second)
	for !regexp.MustCompile(`processed +[1-9]`).MatchString(p.LogTail(5)) {
		if time.Now().After(deadline) {
			t.Fatalf("kfn dev processed nothing in 60s:\n%s", p.LogTail(30))
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := p.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Exited():
	case <-time.After(45 * time.Second):
		t.Fatalf("kfn dev did not stop within 45s of SIGTERM:\n%s", p.LogTail(30))
	}
	if err := p.ExitErr(); err != nil || !strings.Contains(p.LogTail(5), "verify: OK") {
		t.Errorf("kfn dev after SIGTERM: %v, want exit 0 after verify: OK\n%s", err, p.LogTail(30))
	}
}

// TestEveryCommandHasExamples: kfn CMD -h exits 0 and shows examples, for
// every command kfn lists.
func TestEveryCommandHasExamples(t *testing.T) {
	for name := range commands {
		code, errOut, _ := kfn(t, name, "-h")
		if code != 0 || !strings.Contains(errOut, "examples:") {
			t.Errorf("kfn %s -h: exit %d, examples shown: %v", name, code, strings.Contains(errOut, "examples:"))
		}
	}
}
