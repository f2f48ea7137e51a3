package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/dlqtest"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestConsoleRefusesToRunWithoutAuthentication(t *testing.T) {
	code, _, stderr := kfn(t, "console", "--database-url", "postgres://localhost/none")
	if code != 2 || !strings.Contains(stderr, "--auth-file") || !strings.Contains(stderr, "--trust-proxy-header") {
		t.Fatalf("kfn console without auth: exit %d, %q; want 2 naming --auth-file and --trust-proxy-header", code, stderr)
	}
}

func TestConsoleRefusesABadAuthFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "users")
	if err := os.WriteFile(file, []byte("# users\nalice:root:sha256:00\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	code, _, stderr := kfn(t, "console", "--database-url", "postgres://localhost/none", "--auth-file", file)
	if code != 2 || !strings.Contains(stderr, "line 2") || !strings.Contains(stderr, `role "root"`) {
		t.Fatalf("kfn console with a bad auth file: exit %d, %q; want 2 naming line 2 and its role", code, stderr)
	}
}

func TestConsoleServesItsLoginPageUntilStopped(t *testing.T) {
	db := kfntest.Postgres(t)
	sum := sha256.Sum256([]byte("s3cret"))
	file := filepath.Join(t.TempDir(), "users")
	if err := os.WriteFile(file, []byte("alice:writer:sha256:"+hex.EncodeToString(sum[:])+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		var stderr strings.Builder
		done <- run(ctx, []string{"console", "--database-url", db.URL, "--auth-file", file, "--listen", "127.0.0.1:0"}, pw, &stderr)
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil {
		t.Fatalf("no first line from kfn console: %v", err)
	}
	go io.Copy(io.Discard, pr)
	// "kfn console on http://127.0.0.1:PORT (read-only)"
	fields := strings.Fields(line)
	if len(fields) < 4 || !strings.HasPrefix(fields[3], "http://127.0.0.1:") || !strings.Contains(line, "read-only") {
		t.Fatalf("first line: %q", line)
	}
	res, err := http.Get(fields[3] + "/")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusUnauthorized || res.Header.Get("Content-Security-Policy") == "" {
		t.Fatalf("GET / without a session: %d, CSP %q; want 401 with a CSP", res.StatusCode, res.Header.Get("Content-Security-Policy"))
	}
	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("kfn console stopped with exit %d", code)
	}
}

// TestConsoleRefusesAFunctionInTwoDatabases starts kfn console with
// --function-databases: a function given twice is a usage error, as in
// every command, and a function whose dead letters are in its own
// database and in --database-url's is refused before the console serves.
func TestConsoleRefusesAFunctionInTwoDatabases(t *testing.T) {
	dbA, dbB := kfntest.Postgres(t), kfntest.Postgres(t)
	b := kfntest.Name(t, "b")
	file := filepath.Join(t.TempDir(), "users")
	sum := sha256.Sum256([]byte("s3cret"))
	if err := os.WriteFile(file, []byte("alice:writer:sha256:"+hex.EncodeToString(sum[:])+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	args := []string{"console", "--auth-file", file, "--listen", "127.0.0.1:0", "--database-url", dbA.URL}
	code, _, stderr := kfn(t, append(args, "--function-databases", b+"="+dbB.URL+","+b+"="+dbA.URL)...)
	if want := "function " + b + " is given twice"; code != 2 || !strings.Contains(stderr, want) {
		t.Errorf("kfn console with %s given twice: exit %d, %q; want 2 and %q", b, code, stderr, want)
	}
	for _, db := range []*kfntest.PG{dbA, dbB} {
		dlqtest.Seed(t, db.Pool, dlqtest.Letter{Function: b, Topic: "src", Partition: 0, Offset: 1, Reason: "permanent", Error: "bad"})
	}
	code, stdout, stderr := kfn(t, append(args, "--function-databases", b+"="+dbB.URL)...)
	if want := fmt.Sprintf("function %q is in two databases", b); code != 1 || !strings.Contains(stderr, want) || strings.Contains(stdout, "kfn console on") {
		t.Errorf("kfn console with %s's letters in both databases: exit %d, %q%q; want 1, %q, and no console served", b, code, stdout, stderr, want)
	}
}
