package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// syncBuffer is a bytes.Buffer safe to write from kfn dev while the test reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func waitOutput(t *testing.T, b *syncBuffer, limit time.Duration, what string, cond func(string) bool) string {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		out := b.String()
		if cond(out) {
			return out
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s; kfn dev printed:\n%s", limit, what, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestAuthorPathNewDevProduceTail is the README's quick start, run: kfn new
// makes a payments function, kfn dev runs it against a fresh stack, kfn
// produce sends 100 valid and 3 invalid records, and the table, the dead
// letters and kfn tail show exactly what they should; then a source edit
// rebuilds and restarts the function, which goes on without a duplicate.
func TestAuthorPathNewDevProduceTail(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "payments")
	if code, out, errOut := kfn(t, "new", "payments", "--topic", "payments", "--dir", dir, "--kfn", root); code != 0 {
		t.Fatalf("kfn new: exit %d %s %s", code, out, errOut)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var devOut, devErr syncBuffer
	devDone := make(chan int, 1)
	go func() {
		devDone <- run(ctx, []string{"dev", filepath.Join(dir, "cmd", "payments"), "--partitions", "3"}, &devOut, &devErr)
	}()
	defer func() {
		cancel()
		if code := <-devDone; code != 0 {
			t.Errorf("kfn dev exited %d: %s", code, devErr.String())
		}
	}()
	out := waitOutput(t, &devOut, 3*time.Minute, "kfn dev to run the function", func(s string) bool { return strings.Contains(s, "running payments") })
	exports := map[string]string{}
	for _, m := range regexp.MustCompile(`(?m)^export (\w+)='([^']*)'$`).FindAllStringSubmatch(out, -1) {
		exports[m[1]] = m[2]
	}
	brokers, natsURL, dbURL := exports["KFN_KAFKA_BROKERS"], exports["KFN_NATS_URL"], exports["DATABASE_URL"]
	if brokers == "" || natsURL == "" || dbURL == "" {
		t.Fatalf("kfn dev printed no export lines for the stack:\n%s", out)
	}

	var lines []string
	for i := 0; i < 100; i++ {
		lines = append(lines, fmt.Sprintf(`{"key": "p-%d", "value": {"id": "p-%d", "amount_cents": %d}}`, i, i, 100+i))
	}
	lines = append(lines, `{"key": "x-1", "value": "not json"}`, `{"key": "x-2", "value": {"id": "x-2", "amount_cents": -1}}`, `{"key": "x-3", "value": {"id": "x-3", "amount_cents": 1, "extra": true}}`)
	file := filepath.Join(t.TempDir(), "payments.jsonl")
	if err := os.WriteFile(file, []byte(strings.Join(lines, "\n")), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, out, errOut := kfn(t, "produce", "payments", "--file", file, "--kafka-brokers", brokers); code != 0 || !strings.Contains(out, "sent 103 records") {
		t.Fatalf("kfn produce: exit %d %s %s", code, out, errOut)
	}
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	count := func(sql string) int {
		var n int
		if err := pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	waitRows := func(rows, dead int) {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for {
			r, d := count(`SELECT count(*) FROM payments_records`), count(`SELECT count(*) FROM kfn.dead_letters WHERE consumer = 'payments' AND reason = 'permanent'`)
			if r == rows && d == dead {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("payments_records has %d rows and %d dead letters, want %d and %d; kfn dev printed:\n%s", r, d, rows, dead, devOut.String())
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	waitRows(100, 3)

	code, out, errOut := kfn(t, "tail", "payments.processed", "--all", "--count", "100", "--json", "--nats-url", natsURL)
	ids := map[string]bool{}
	dec := json.NewDecoder(strings.NewReader(out))
	for dec.More() {
		var ev tailedEvent
		if err := dec.Decode(&ev); err != nil {
			t.Fatal(err)
		}
		ids[ev.ID] = true
	}
	if code != 0 || len(ids) != 100 {
		t.Fatalf("kfn tail: exit %d, %d distinct events, want 100 (%s)", code, len(ids), errOut)
	}

	// A source edit: kfn dev rebuilds and restarts the function.
	src := filepath.Join(dir, "payments.go")
	code0, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(src, append(code0, []byte("\n// edited while kfn dev runs\n")...), 0o644); err != nil {
		t.Fatal(err)
	}
	waitOutput(t, &devOut, time.Minute, "the rebuild and restart", func(s string) bool { return strings.Contains(s, "payments changed: rebuilt and restarted") })
	lines = lines[:0]
	for i := 100; i < 110; i++ {
		lines = append(lines, fmt.Sprintf(`{"key": "p-%d", "value": {"id": "p-%d", "amount_cents": %d}}`, i, i, 100+i))
	}
	os.WriteFile(file, []byte(strings.Join(lines, "\n")), 0o600) //nolint:errcheck
	if code, _, errOut := kfn(t, "produce", "payments", "--file", file, "--kafka-brokers", brokers); code != 0 {
		t.Fatalf("kfn produce after the restart: exit %d %s", code, errOut)
	}
	waitRows(110, 3)
	progress := regexp.MustCompile(`payments: applied +(\d+) +duplicates skipped +(\d+) +dead-lettered +(\d+)`)
	waitOutput(t, &devOut, 30*time.Second, "the counters to show 110 applied", func(s string) bool {
		m := progress.FindAllStringSubmatch(s, -1)
		return len(m) > 0 && m[len(m)-1][1] == "110"
	})
	m := progress.FindAllStringSubmatch(devOut.String(), -1)
	if last := m[len(m)-1]; last[2] != "0" || last[3] != "3" {
		t.Errorf("after the restart kfn dev shows %s duplicates skipped and %s dead-lettered, want 0 and 3: %s", last[2], last[3], last[0])
	}
}
