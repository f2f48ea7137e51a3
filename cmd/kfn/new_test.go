package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestNewScaffoldBuildsAndItsTestPasses generates a Kafka-triggered and a
// NATS-triggered function against this checkout, and runs go vet and the
// generated unit test in each, as a user would right after kfn new, and
// the binary's migrate mode. It then breaks the generated handler and sees
// the generated test fail.
func TestNewScaffoldBuildsAndItsTestPasses(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ name, flag, value string }{{"payments", "--topic", "payments"}, {"receipts", "--subject", "payments.captured"}} {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), c.name)
			code, out, errOut := kfn(t, "new", c.name, c.flag, c.value, "--dir", dir, "--kfn", root)
			if code != 0 {
				t.Fatalf("kfn new: exit %d, %s %s", code, out, errOut)
			}
			for _, f := range []string{"go.mod", c.name + ".go", c.name + "_test.go", "cmd/" + c.name + "/main.go", "Containerfile", "deploy/kustomization.yaml", "deploy/deployment.yaml", "README.md"} {
				if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
					t.Errorf("missing %s: %v", f, err)
				}
			}
			goRun := func(args ...string) (string, error) {
				var buf bytes.Buffer
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
				defer cancel()
				err := goIn(ctx, dir, &buf, &buf, args...)
				return buf.String(), err
			}
			if out, err := goRun("vet", "./..."); err != nil {
				t.Fatalf("go vet in the scaffold: %v\n%s", err, out)
			}
			if out, err := goRun("test", "-count=1", "./..."); err != nil {
				t.Fatalf("the scaffold's test fails: %v\n%s", err, out)
			}
			// Its binary's migrate mode applies kfn's schema and the
			// function's Setup, as the migrator of a production database
			// would run it once.
			db := kfntest.PostgresEmpty(t)
			if out, err := goRun("run", "./cmd/"+c.name, "migrate", "--database-url", db.URL); err != nil || !strings.Contains(out, "function "+c.name+": Setup applied") {
				t.Fatalf("%s migrate: %v\n%s", c.name, err, out)
			}
			var tables int
			if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_tables WHERE (schemaname, tablename) IN (('kfn', 'cursors'), ('public', $1))`, c.name+"_records").Scan(&tables); err != nil || tables != 2 {
				t.Errorf("after %s migrate: %d of kfn.cursors and %s_records exist (%v), want both", c.name, tables, c.name, err)
			}
			// The generated test can fail: a handler that stores nothing.
			src := filepath.Join(dir, c.name+".go")
			code0, _ := os.ReadFile(src)
			broken := strings.Replace(string(code0), "INSERT INTO", "SELECT 1 WHERE false AND EXISTS (SELECT 1) --", 1)
			if err := os.WriteFile(src, []byte(broken), 0o644); err != nil {
				t.Fatal(err)
			}
			if out, err := goRun("test", "-count=1", "./..."); err == nil || !strings.Contains(out, "rows stored") {
				t.Errorf("the scaffold's test passed with a handler that stores nothing:\n%s", out)
			}
		})
	}
	for _, args := range [][]string{{"new"}, {"new", "Bad Name"}, {"new", "x", "--topic", "a", "--subject", "b"}, {"new", "x", "--subject", "a..b"}} {
		if code, _, _ := kfn(t, args...); code != 2 {
			t.Errorf("kfn %v: exit %d, want 2", args, code)
		}
	}
}
