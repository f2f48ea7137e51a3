package main

import (
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestBenchRunsEveryModeAndCountsCPUByProcess runs a small kfn bench
// against the test services, with as many naive records as records (that
// hung: the naive mode waited for one record more than there were), and
// checks that every mode reports records and CPU time, that the Postgres
// server's processes are counted, and that the ratios and the relay's
// figures are printed.
func TestBenchRunsEveryModeAndCountsCPUByProcess(t *testing.T) {
	pg, k := kfntest.Postgres(t), kfntest.Kafka(t)
	code, stdout, stderr := kfn(t, "bench", "--records", "2000", "--naive-records", "2000", "--rounds", "1", "--partitions", "2",
		"--batch-size", "100", "--relay-events", "300", "--relay-duration", "300ms",
		"--database-url", pg.URL, "--nats-url", kfntest.NATSURL(t), "--kafka-brokers", strings.Join(k.Brokers, ","))
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
	for _, mode := range []string{"copy limit", "exactly-once", "at-least-once", "naive", "pipeline", "chain"} {
		line := regexp.MustCompile(`(?m)^` + mode + `  .*$`).FindString(stdout)
		f := strings.Fields(strings.TrimPrefix(line, mode))
		if len(f) < 4 || postgres < 0 || len(f) <= postgres-1 {
			t.Errorf("no result line for %s (header %q):\n%s", mode, header, stdout)
			continue
		}
		records, _ := strconv.Atoi(f[0])
		total, _ := strconv.ParseFloat(f[3], 64)
		pgCPU, _ := strconv.ParseFloat(f[postgres-1], 64) // the mode's name is one column of the header
		// CPU time comes in ticks of 10 ms: the short modes may see none
		// in Postgres. The copy limit of 2,000 records costs Postgres about
		// 50 ms (600 records, about 15 ms, once showed none), and the naive
		// mode commits once per record: both always see some.
		if records <= 0 || total <= 0 || (pgCPU <= 0 && (mode == "copy limit" || mode == "naive")) {
			t.Errorf("%s: %d records, %.2f CPU-s/10k in all, %.2f in Postgres; want them positive:\n%s", mode, records, total, pgCPU, line)
		}
	}
	for _, want := range []string{`exactly-once / copy limit += [\d.]+`, `exactly-once / at-least-once = [\d.]+`, `exactly-once / naive += [\d.]+×`,
		`pipeline CPU = [\d.]+ CPU-s/10k`,
		`(?m)^relay +300 +[\d.]+ +\d+$`, `(?m)^naive relay +\d+ +[\d.]+ +\d+$`, `relay / naive relay = [\d.]+×`,
		`commit→ack latency at \d+ events/s \(\d+ events\): p50 \S+ +p99 \S+`} {
		if !regexp.MustCompile(want).MatchString(stdout) {
			t.Errorf("bench output does not match %q:\n%s", want, stdout)
		}
	}
	if !strings.Contains(stderr, "round 1/1  chain") {
		t.Errorf("no progress line for the chain on stderr:\n%s", stderr)
	}
}
