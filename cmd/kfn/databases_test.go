package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/dlqtest"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestCommandsFindEachFunctionsDatabase puts function a on one database
// and b on another, each with a cursor and a dead letter, and checks that the operator commands find each: status and dlq
// list read both databases without --function and b's alone with
// --function b, dlq show and discard find b's letter with --function b,
// and a
// function that is neither listed nor served by --database-url is a
// usage error naming both flags.
func TestCommandsFindEachFunctionsDatabase(t *testing.T) {
	dbA, dbB := kfntest.Postgres(t), kfntest.Postgres(t)
	a, b := kfntest.Name(t, "a"), kfntest.Name(t, "b")
	ctx := context.Background()
	letters := map[string]int64{}
	for _, s := range []struct {
		db *kfntest.PG
		fn string
	}{{dbA, a}, {dbB, b}} {
		if _, err := s.db.Pool.Exec(ctx, `INSERT INTO kfn.cursors (consumer, topic, partition, next_offset, high_water, epoch, owner) VALUES ($1, 'src', 0, 2, 2, 1, 'w')`, s.fn); err != nil {
			t.Fatal(err)
		}
		letters[s.fn] = dlqtest.Seed(t, s.db.Pool, dlqtest.Letter{Function: s.fn, Topic: "src", Partition: 0, Offset: 1, Reason: "permanent", Error: "bad " + s.fn, Age: time.Minute})[0]
	}
	both := []string{"--database-url", dbA.URL, "--function-databases", b + "=" + dbB.URL}
	functionsIn := func(args ...string) map[string]int {
		t.Helper()
		code, out, stderr := kfn(t, append(args, both...)...)
		if code != 0 {
			t.Fatalf("kfn %s: exit %d: %s", strings.Join(args, " "), code, stderr)
		}
		var rows []struct {
			Function string `json:"function"`
		}
		if err := json.Unmarshal([]byte(out), &rows); err != nil {
			t.Fatalf("kfn %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		seen := map[string]int{}
		for _, r := range rows {
			seen[r.Function]++
		}
		return seen
	}
	for _, c := range []struct {
		args []string
		want map[string]int
	}{
		{[]string{"status", "--json"}, map[string]int{a: 1, b: 1}},
		{[]string{"status", "--json", "--function", b}, map[string]int{b: 1}},
		{[]string{"dlq", "list", "--json"}, map[string]int{a: 1, b: 1}},
		{[]string{"dlq", "list", "--json", "--function", b}, map[string]int{b: 1}},
		{[]string{"dlq", "list", "--json", "--topic", "src"}, map[string]int{a: 1, b: 1}},
	} {
		if got := functionsIn(c.args...); fmt.Sprint(got) != fmt.Sprint(c.want) {
			t.Errorf("kfn %s over both databases: lanes or letters of %v, want %v", strings.Join(c.args, " "), got, c.want)
		}
	}
	code, out, stderr := kfn(t, append([]string{"dlq", "show", fmt.Sprint(letters[b]), "--function", b}, both...)...)
	if code != 0 || !strings.Contains(out, "bad "+b) {
		t.Errorf("kfn dlq show %d --function %s: exit %d, %s%s; want b's letter from b's database", letters[b], b, code, out, stderr)
	}
	code, out, stderr = kfn(t, append([]string{"dlq", "discard", fmt.Sprint(letters[b]), "--function", b, "--reason", "test", "--dry-run"}, both...)...)
	if code != 0 || !strings.Contains(out, "bad "+b) || !strings.Contains(out, "1 dead letter would be discarded") {
		t.Errorf("kfn dlq discard %d --function %s --dry-run: exit %d, %s%s; want b's letter from b's database", letters[b], b, code, out, stderr)
	}
	code, _, stderr = kfn(t, "status", "--function", a, "--function-databases", b+"="+dbB.URL)
	want := fmt.Sprintf(`kfn status: function %q is not in --function-databases: give its database there, or --database-url (or set DATABASE_URL)`, a)
	if code != 2 || !strings.HasPrefix(stderr, want) {
		t.Errorf("kfn status --function %s with only b's database: exit %d, %q; want exit 2 and %q", a, code, stderr, want)
	}
	code, _, stderr = kfn(t, "status", "--function-databases", b+"="+dbB.URL+","+b+"=postgres://elsewhere/db,c")
	for _, w := range []string{"kfn status: invalid configuration: --function-databases (KFN_FUNCTION_DATABASES): function " + b + " is given twice", `"c" is not FUNCTION=URL`} {
		if code != 2 || !strings.Contains(stderr, w) {
			t.Errorf("kfn status with a bad --function-databases: exit %d, %q; want exit 2 and %q", code, stderr, w)
		}
	}
}
