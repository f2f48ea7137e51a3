package main

import (
	"bytes"
	"context"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/cmd/kfn/internal/bench"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestBenchRunsEveryModeAndCountsCPUByProcess runs a small kfn bench
// against the test services, with as many naive records as records (that
// hung: the naive mode waited for one record more than there were), and
// checks that every mode reports records, CPU time, commit latency and
// memory, that the Postgres server's processes are counted, that the
// ratios and the relay's figures (its share of the worker's CPU, commit→ack
// at 50% and 80% of the maximum rate, in both outbox modes) are printed, that progress shows while a mode
// runs, and that the report file holds it all with the command and the
// machine.
func TestBenchRunsEveryModeAndCountsCPUByProcess(t *testing.T) {
	pg, k := kfntest.Postgres(t), kfntest.Kafka(t)
	reports := t.TempDir()
	args := []string{"bench", "--records", "2000", "--naive-records", "2000", "--rounds", "1", "--partitions", "2",
		"--batch-size", "100", "--relay-events", "300", "--relay-duration", "300ms", "--progress-every", "100ms", "--report-dir", reports, "--starts", "2",
		"--database-url", pg.URL, "--nats-url", kfntest.NATSURL(t), "--kafka-brokers", strings.Join(k.Brokers, ",")}
	started := time.Now()
	code, stdout, stderr := kfn(t, args...)
	if code != 0 {
		t.Fatalf("kfn bench exited %d:\n%s\n%s", code, stdout, stderr)
	}
	t.Logf("kfn bench:\n%s", stdout)
	if !strings.Contains(stdout, "postgres (pid ") {
		t.Errorf("the Postgres server's processes are not counted:\n%s", stdout)
	}
	header := regexp.MustCompile(`(?m)^MODE .*$`).FindString(stdout)
	columns := strings.Fields(header)
	postgres := -1
	for i, c := range columns {
		if c == "POSTGRES" {
			postgres = i
		}
	}
	for _, mode := range []string{"copy limit", "wal limit", "exactly-once", "at-least-once", "naive", "pipeline", "pipeline (wal)", "chain"} {
		line := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(mode) + `  .*$`).FindString(stdout)
		f := strings.Fields(strings.TrimPrefix(line, mode))
		if len(f) < 4 || postgres < 0 || len(f) <= postgres-1 {
			t.Errorf("no result line for %s (header %q):\n%s", mode, header, stdout)
			continue
		}
		records, _ := strconv.Atoi(f[0])
		total, _ := strconv.ParseFloat(f[3], 64)
		pgCPU, _ := strconv.ParseFloat(f[postgres-1], 64) // the mode's name is one column of the header
		// CPU time comes in ticks of 10 ms per process: the short modes may
		// see none in Postgres. The copy limit reports its sweep's best
		// setting, whose 2,000 rows may go over 8 connections: 8 backends
		// of a few ms each, which a CI run saw as 0.00. The naive mode
		// commits once per record on one connection: it always sees some.
		if records <= 0 || total <= 0 || (pgCPU <= 0 && mode == "naive") {
			t.Errorf("%s: %d records, %.2f CPU-s/10k in all, %.2f in Postgres; want them positive:\n%s", mode, records, total, pgCPU, line)
		}
	}
	for _, mode := range []string{"copy limit", "wal limit", "exactly-once", "at-least-once", "naive", "pipeline", "pipeline (wal)", "chain"} {
		// MODE COMMIT-P50 COMMIT-P99 TRANSACTIONS PEAK-RSS POSTGRES-MEMORY
		line := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(mode) + `  +(\S+) +(\S+) +(\d+) +(\d+) MiB +(\d+) MiB$`).FindStringSubmatch(stdout)
		if line == nil {
			t.Errorf("no commit latency and memory line for %s:\n%s", mode, stdout)
			continue
		}
		p50, err50 := time.ParseDuration(line[1])
		p99, err99 := time.ParseDuration(line[2])
		txs, _ := strconv.Atoi(line[3])
		rss, _ := strconv.Atoi(line[4])
		pgMem, _ := strconv.Atoi(line[5])
		if err50 != nil || err99 != nil || p50 <= 0 || p99 < p50 || txs <= 0 || rss <= 0 || pgMem <= 0 {
			t.Errorf("%s: commit p50 %q p99 %q over %d transactions, peak RSS %d MiB, Postgres %d MiB; want 0 < p50 <= p99, and the rest positive", mode, line[1], line[2], txs, rss, pgMem)
		}
	}
	for _, want := range []string{`exactly-once / copy limit += [\d.]+.*\(the swept ceiling, reached with batch \d+ × \d+ connections\)`,
		`exactly-once / at-least-once = [\d.]+; by round [\d.]+ \([\d. ]+\); by CPU per record [\d.]+ \([\d. ]+\)  \(goal >= 0\.90, with the compact inbox key\)`,
		`wal limit / copy limit += [\d.]+.*reached with batch \d+ × \d+ connections\)`,
		// Batch sizes 500 to 5,000, and 1 to twice the 2 partitions' connections.
		`(?m)^copy limit: best of the sweep, batch \d+ × \d+ connections \(its median round's msgs/s by batch×connections: 500×1 \d+, 500×2 \d+, 500×4 \d+, 1000×1 \d+, .*, 5000×4 \d+\)$`,
		`(?m)^wal limit: best of the sweep, batch \d+ × \d+ connections \(.*5000×4 \d+\)$`, `exactly-once / naive += [\d.]+×`,
		`pipeline CPU = [\d.]+ CPU-s/10k`,
		`relay share of the worker's CPU: [\d.]+%`,
		`(?m)^relay +300 +[\d.]+ +\d+$`, `(?m)^naive relay +\d+ +[\d.]+ +\d+$`, `relay / naive relay = [\d.]+×`,
		`relay cost on the backlog, in this process: [\d.]+ µs CPU`,
		`(?m)^relay: .*commit→ack latency, the table and the wal outbox, each for 300ms at 50% and 80% of its maximum rate`,
		`(?m)^OUTBOX +MAX-RATE +LOAD +ASKED/S +REACHED/S +EVENTS +P50 +P99 +MAX +COMMIT-P50 +COMMIT-P99 +REPLY-P50 +REPLY-P99$`,
		`(?m)^command: kfn bench --records 2000 --naive-records 2000 .*--report-dir ` + regexp.QuoteMeta(reports) + ` `,
		`(?m)^machine: .+, \d+ CPUs, [\d.]+ GiB memory; .+, Linux .+; go.+; load average [\d.]+ [\d.]+ [\d.]+ at start$`,
		`(?m)^start → first commit: p50 \S+ +p90 \S+ +over 2 starts \(goal <= 0\.25 s\)$`, `(?m)^  commit +[\d.]+ ms +[\d.]+ ms +[\d.]+ ms$`,
		`(?m)^versions: Postgres \d+\.\d+.*, NATS 2\.\d+\.\d+, Kafka: (embedded broker \(franz-go kfake v\S+\)|Apache Kafka \d\S*)$`} {
		if !regexp.MustCompile(want).MatchString(stdout) {
			t.Errorf("bench output does not match %q:\n%s", want, stdout)
		}
	}
	// A small topic is run over until the share rests on 50 samples.
	if m := regexp.MustCompile(`relay share of the worker's CPU: .* in (\d+) passes, .*; (\d+) profile samples\)`).FindStringSubmatch(stdout); m == nil {
		t.Errorf("the relay share names no passes and samples:\n%s", stdout)
	} else if samples, _ := strconv.Atoi(m[2]); samples < 50 {
		t.Errorf("the relay share rests on %s samples over %s passes; want at least 50", m[2], m[1])
	}
	checkRelayLatency(t, stdout, 300*time.Millisecond)
	if !strings.Contains(stderr, "round 1/1  chain") {
		t.Errorf("no progress line for the chain on stderr:\n%s", stderr)
	}
	// The naive mode, one transaction per record, runs for seconds.
	if !regexp.MustCompile(`(?m)^round 1/1  naive +\d+ records so far, \d+ s$`).MatchString(stderr) {
		t.Errorf("no progress while the naive mode runs on stderr:\n%s", stderr)
	}

	files, _ := filepath.Glob(filepath.Join(reports, "*.txt"))
	if len(files) != 1 {
		t.Fatalf("report files in --report-dir: %v; want one", files)
	}
	name := filepath.Base(files[0])
	stamp, err := time.Parse("20060102T150405Z", strings.SplitN(name, "-", 2)[0])
	if err != nil || stamp.Before(started.Truncate(time.Second).Add(-time.Second)) || stamp.After(time.Now()) || !regexp.MustCompile(`-\d+cpu-\d+gib\.txt$`).MatchString(name) {
		t.Errorf("report %s: want <start time, UTC>-<n>cpu-<n>gib.txt (%v)", name, err)
	}
	report, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	if want := stdout[:strings.LastIndex(stdout, "\nreport: ")]; string(report) != want {
		t.Errorf("the report is not what stdout showed:\n%s\nstdout:\n%s", report, stdout)
	}
	if !strings.HasSuffix(stdout, "\nreport: "+files[0]+"\n") {
		t.Errorf("stdout does not end with the report's path:\n%s", stdout)
	}
}

// checkRelayLatency checks kfn bench's commit→ack table: for the table
// and the wal outbox, a max rate and a paced run at 50% and 80% of it, each
// asking its share of the max rate and committing no more than that rate
// for d allows (at least one transaction of 50 events per each of the 4
// sessions), with p50 <= p99 <= max and the parts within the whole.
func checkRelayLatency(t *testing.T, stdout string, d time.Duration) {
	t.Helper()
	row := regexp.MustCompile(`(?m)^(table|wal) +(\d+) +(50|80)% +(\d+) +(\d+) +(\d+) +(\S+) +(\S+) +(\S+) +(\S+) +(\S+) +(\S+) +(\S+)$`)
	asked := map[string]map[string]float64{}
	for _, m := range row.FindAllStringSubmatch(stdout, -1) {
		mode, load := m[1], m[3]
		var n [4]float64
		for i, f := range []string{m[2], m[4], m[5], m[6]} {
			n[i], _ = strconv.ParseFloat(f, 64)
		}
		maxRate, rate, reached, events := n[0], n[1], n[2], n[3]
		var d7 [7]time.Duration
		for i := range d7 {
			var err error
			if d7[i], err = time.ParseDuration(m[7+i]); err != nil {
				t.Errorf("%s outbox at %s%%: %q is no duration: %v", mode, load, m[7+i], err)
			}
		}
		p50, p99, most, commit50, commit99, reply50, reply99 := d7[0], d7[1], d7[2], d7[3], d7[4], d7[5], d7[6]
		share, _ := strconv.ParseFloat(load, 64)
		// The max rate is printed rounded, and its share truncated: up to 1.4 off.
		if want := max(1, share/100*maxRate); maxRate <= 0 || math.Abs(rate-want) > 1.5 {
			t.Errorf("%s outbox at %s%%: asked %.0f/s of a max rate of %.0f/s; want %.0f/s", mode, load, rate, maxRate, want)
		}
		if reached <= 0 || events <= 0 || events > rate*d.Seconds()+4*50 {
			t.Errorf("%s outbox at %s%%: %.0f events, %.0f/s reached; want them positive and no more events than %.0f/s for %s allows", mode, load, events, reached, rate, d)
		}
		// Each event's latency from sending COMMIT is its transaction's
		// COMMIT round trip plus its latency from the reply.
		if p50 <= 0 || p50 > p99 || p99 > most || commit50 <= 0 || commit50 > commit99 || commit50 > p50 || reply50 > p50 || reply99 > p99 || reply50 > reply99 {
			t.Errorf("%s outbox at %s%%: p50 %v p99 %v max %v, COMMIT p50 %v p99 %v, from its reply p50 %v p99 %v: want 0 < p50 <= p99 <= max and the parts within the whole",
				mode, load, p50, p99, most, commit50, commit99, reply50, reply99)
		}
		if asked[mode] == nil {
			asked[mode] = map[string]float64{"max": maxRate}
		}
		asked[mode][load] = rate
	}
	for _, mode := range []string{"table", "wal"} {
		r := asked[mode]
		if len(r) != 3 {
			t.Errorf("%s outbox: commit→ack rows %v; want the max rate, 50%% and 80%%:\n%s", mode, r, stdout)
			continue
		}
		if !(r["50"] < r["80"] && r["80"] < r["max"]) {
			t.Errorf("%s outbox: asked %.0f/s at 50%%, %.0f/s at 80%%, of a max rate of %.0f/s; want them in that order", mode, r["50"], r["80"], r["max"])
		}
	}
}

// The report's command line hides a secret setting's value, given as a
// flag or a variable, and names the variables a setting came from.
func TestBenchCommandRedactsSecrets(t *testing.T) {
	t.Setenv("KFN_NATS_URL", "nats://s3cret-token@127.0.0.1:4222")
	t.Setenv("KFN_BATCH_WAIT", "5ms")
	fs := newFlags("bench", help{}, nil)
	addServiceFlags(fs)
	var wait time.Duration
	settings.BatchWait.Bind(fs.settings, &wait)
	records := fs.Int64("records", 0, "")
	args := []string{"--database-url", "postgres://kfn:hunter2@db/kfn", "--records", "100", "--database-url=postgres://kfn:hunter3@db/kfn?sslmode=require", "--report-dir", "a b"}
	fs.String("report-dir", "", "")
	if err := parse(fs, args); err != nil || *records != 100 {
		t.Fatalf("parse: %v", err)
	}
	command, env := benchCommand(fs, args)
	const want = "kfn bench --database-url postgres://kfn:xxxxx@db/kfn --records 100 '--database-url=postgres://kfn:xxxxx@db/kfn?sslmode=require' --report-dir 'a b'"
	if command != want {
		t.Errorf("command:\n%s\nwant:\n%s", command, want)
	}
	got := " " + strings.Join(env, " ") + " "
	if !strings.Contains(got, " KFN_NATS_URL=nats://xxxxx@127.0.0.1:4222 ") || !strings.Contains(got, " KFN_BATCH_WAIT=5ms ") || strings.Contains(got, "s3cret") {
		t.Errorf("environment: %s; want KFN_NATS_URL redacted and KFN_BATCH_WAIT", got)
	}
}

// TestBenchKeyLanesReportsTheRatio runs kfn bench's key-lanes benchmark
// alone, small, against the test services: a handler waiting 5 ms per
// record on one partition, as one lane and as 16 key-lanes, each run's
// rate and CPU, and the ratio of the rates (the figure docs/scaling.md
// records; its size is the benchmark's business, not this test's).
func TestBenchKeyLanesReportsTheRatio(t *testing.T) {
	pg, k := kfntest.Postgres(t), kfntest.Kafka(t)
	code, stdout, stderr := kfn(t, "bench", "--key-lanes-only", "--key-lanes-records", "300", "--rounds", "1", "--report-dir", "",
		"--database-url", pg.URL, "--nats-url", kfntest.NATSURL(t), "--kafka-brokers", strings.Join(k.Brokers, ","))
	if code != 0 {
		t.Fatalf("kfn bench --key-lanes-only exited %d:\n%s\n%s", code, stdout, stderr)
	}
	t.Logf("kfn bench --key-lanes-only:\n%s", stdout)
	for _, k := range []string{"1", "16"} {
		line := regexp.MustCompile(`(?m)^  KeyConcurrency ` + k + ` +(\d+) records +([0-9.]+) s +(\d+) msgs/s +([0-9.]+) CPU-s/10k  \(rounds: \d+ msgs/s\)$`).FindStringSubmatch(stdout)
		if line == nil {
			t.Errorf("no result line for KeyConcurrency %s:\n%s", k, stdout)
			continue
		}
		if n, _ := strconv.Atoi(line[1]); n <= 0 {
			t.Errorf("KeyConcurrency %s applied %d records", k, n)
		}
	}
	ratio := regexp.MustCompile(`(?m)^  16 key-lanes / 1: ([0-9.]+)× the rate \(medians of 1 interleaved rounds\)$`).FindStringSubmatch(stdout)
	if ratio == nil {
		t.Fatalf("no ratio line:\n%s", stdout)
	}
	if r, err := strconv.ParseFloat(ratio[1], 64); err != nil || r <= 0 {
		t.Errorf("ratio %q: want a positive number", ratio[1])
	}
	if strings.Contains(stdout, "exactly-once") {
		t.Errorf("--key-lanes-only ran the other modes too:\n%s", stdout)
	}
}

// TestBenchWritesOnlyIntoADatabaseOfItsOwn points kfn bench, twice in a
// row, at a database that already holds a table named orders with rows of
// its own (the orders function's table name: kfn bench used to write its
// orders there and failed on the second run with a duplicate key), then
// interrupts a third run. The rows stay as they were, kfn's schema is
// never created there, and no database of the benchmark's is left: the
// runs drop theirs at the end, the interrupted one too, and a scratch
// database a killed run left behind is dropped by the next run. Nor is a
// replication slot left (the WAL outbox's, which the pipeline (wal) mode
// reads): a slot left behind would hold the server's WAL forever.
func TestBenchWritesOnlyIntoADatabaseOfItsOwn(t *testing.T) {
	pg, k := kfntest.PostgresEmpty(t), kfntest.Kafka(t)
	ctx := context.Background()
	for _, sql := range []string{
		`CREATE TABLE orders (order_id text PRIMARY KEY, customer text NOT NULL, amount_cents bigint NOT NULL, currency text NOT NULL)`,
		`INSERT INTO orders VALUES ('order-0', 'a user''s own', 1, 'EUR'), ('order-1', 'a user''s own', 2, 'EUR'), ('mine', 'x', 3, 'USD')`,
		// What a run killed by SIGKILL leaves.
		`CREATE DATABASE kfn_bench_killedrun`,
		`COMMENT ON DATABASE kfn_bench_killedrun IS '` + scratchComment + `'`,
	} {
		if _, err := pg.Pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	killedRun, err := pgx.Connect(ctx, withDatabase(pg.URL, "kfn_bench_killedrun"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := killedRun.Exec(ctx, `SELECT pg_create_logical_replication_slot('kfn_bench_killedrun_slot', 'pgoutput')`); err != nil {
		t.Fatal(err)
	}
	killedRun.Close(ctx)
	state := func() string {
		t.Helper()
		var s string
		err := pg.Pool.QueryRow(ctx, `SELECT (SELECT string_agg(format('%s %s %s %s', order_id, customer, amount_cents, currency), ', ' ORDER BY order_id) FROM orders)
		  || ' | tables: ' || (SELECT string_agg(schemaname || '.' || tablename, ' ' ORDER BY 1) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema'))`).Scan(&s)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	list := func(sql string) []string {
		t.Helper()
		rows, err := pg.Pool.Query(ctx, sql)
		if err != nil {
			t.Fatal(err)
		}
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return names
	}
	scratch := func() []string {
		return list(`SELECT datname FROM pg_database WHERE datname LIKE 'kfn\_bench\_%' ORDER BY 1`)
	}
	slots := func() []string {
		return list(`SELECT slot_name || ' in ' || coalesce(database, '-') FROM pg_replication_slots ORDER BY 1`)
	}
	before := state()
	const want = "mine x 3 USD, order-0 a user's own 1 EUR, order-1 a user's own 2 EUR | tables: public.orders"
	if before != want {
		t.Fatalf("the database before kfn bench: %s", before)
	}
	args := []string{"bench", "--records", "400", "--naive-records", "2", "--rounds", "1", "--partitions", "2", "--batch-size", "100",
		"--relay-events", "100", "--relay-duration", "200ms", "--report-dir", "",
		"--database-url", pg.URL, "--nats-url", kfntest.NATSURL(t), "--kafka-brokers", strings.Join(k.Brokers, ",")}
	for run := 1; run <= 2; run++ {
		code, stdout, stderr := kfn(t, args...)
		if code != 0 {
			t.Fatalf("kfn bench, run %d, exited %d:\n%s\n%s", run, code, stdout, stderr)
		}
		if run == 1 && !strings.Contains(stdout, "dropped 1 scratch database(s) an interrupted kfn bench left behind: kfn_bench_killedrun") {
			t.Errorf("run 1 did not say it dropped the database a killed run left:\n%s", stdout)
		}
		if !regexp.MustCompile(`(?m)^database  kfn_bench_[0-9a-f]{12} on that server, the benchmark's own`).MatchString(stdout) {
			t.Errorf("run %d does not name its own database:\n%s", run, stdout)
		}
		if got := state(); got != before {
			t.Errorf("after run %d the database holds %s; before %s", run, got, before)
		}
		if left := scratch(); len(left) > 0 {
			t.Errorf("after run %d these benchmark databases are left: %v", run, left)
		}
		if left := slots(); len(left) > 0 {
			t.Errorf("after run %d these replication slots are left: %v", run, left)
		}
		if !regexp.MustCompile(`(?m)^pipeline \(wal\)\s+\d+`).MatchString(stdout) {
			t.Errorf("run %d did not measure the pipeline with the WAL outbox:\n%s", run, stdout)
		}
	}

	// An interrupted run (SIGINT cancels kfn's context) drops its database too.
	runCtx, interrupt := context.WithCancel(ctx)
	exited := make(chan int, 1)
	go func() {
		var out, errOut bytes.Buffer
		exited <- run(runCtx, append(append(args[:2:2], "20000"), args[3:]...), &out, &errOut)
	}()
	waitFor(t, "the interrupted run's database and its WAL outbox slot", func() bool { return len(scratch()) == 1 && len(slots()) == 1 })
	time.Sleep(time.Second)
	interrupt()
	select {
	case code := <-exited:
		if code == 0 {
			t.Errorf("the interrupted kfn bench exited 0")
		}
	case <-time.After(time.Minute):
		t.Fatal("kfn bench did not stop within a minute of its interruption")
	}
	if left := scratch(); len(left) > 0 {
		t.Errorf("after an interrupted run these benchmark databases are left: %v", left)
	}
	if left := slots(); len(left) > 0 {
		t.Errorf("after an interrupted run these replication slots are left: %v", left)
	}
	if got := state(); got != before {
		t.Errorf("after the interrupted run the database holds %s; before %s", got, before)
	}
}

func TestRatiosGiveTheMediansByRoundAndByCPU(t *testing.T) {
	a := bench.Result{PerSecond: 900, Rounds: []float64{900, 800, 1000}, RoundsCPU: []float64{0.50, 0.40, 0.25}}
	b := bench.Result{PerSecond: 1000, Rounds: []float64{1000, 1000, 1000}, RoundsCPU: []float64{0.40, 0.36, 0.25}}
	// Rounds: 0.90 0.80 1.00 (median 0.90); CPU, b's over a's: 0.80 0.90 1.00 (median 0.90).
	if got, want := ratios(a, b), "0.90; by round 0.90 (0.90 0.80 1.00); by CPU per record 0.90 (0.80 0.90 1.00)"; got != want {
		t.Errorf("ratios = %q, want %q", got, want)
	}
	b.RoundsCPU = nil
	if got, want := ratios(a, b), "0.90; by round 0.90 (0.90 0.80 1.00)"; got != want {
		t.Errorf("ratios without CPU = %q, want %q", got, want)
	}
}
