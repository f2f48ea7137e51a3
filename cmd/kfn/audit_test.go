package main

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/dlqtest"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestAuditListsActionsButClaimsUnlessAsked(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	// A claim as a worker writes it, then an operator's discard and purge.
	if _, err := inbox.ClaimPartition(ctx, db.Pool, inbox.Partition{Consumer: "fa", Topic: "ta", Partition: 0}, 1, "worker-1", 0); err != nil {
		t.Fatal(err)
	}
	id := dlqtest.Seed(t, db.Pool, fourLetters...)
	if code, _, stderr := kfn(t, "dlq", "discard", "--database-url", db.URL, fmt.Sprint(id[1]), "--reason", "INC-3: resent by hand", "--actor", "alice"); code != 0 {
		t.Fatal(stderr)
	}
	if code, _, stderr := kfn(t, "dlq", "discard", "--database-url", db.URL, "--function", "fb", "--reason", "test data", "--actor", "bob"); code != 0 {
		t.Fatal(stderr)
	}
	if code, _, stderr := kfn(t, "dlq", "purge", "--database-url", db.URL, "--older-than", "2h", "--actor", "alice"); code != 0 {
		t.Fatal(stderr)
	}
	auditJSONOf := func(args ...string) []auditJSON {
		t.Helper()
		code, out, stderr := kfn(t, append([]string{"audit", "--database-url", db.URL, "--json"}, args...)...)
		var rows []auditJSON
		if code != 0 || json.Unmarshal([]byte(out), &rows) != nil {
			t.Fatalf("kfn audit %q: exit %d, out %q, err %q", args, code, out, stderr)
		}
		return rows
	}
	actions := func(rows []auditJSON) string {
		var s []string
		for _, r := range rows {
			s = append(s, r.Action+":"+r.Actor)
		}
		return strings.Join(s, " ")
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "discard:alice discard:bob purge:alice"},
		{[]string{"--action", "claim"}, "claim:worker-1"},
		{[]string{"--action", "discard"}, "discard:alice discard:bob"},
		{[]string{"--actor", "ali"}, "discard:alice purge:alice"},
		{[]string{"--function", "fb"}, "discard:bob"},
		{[]string{"--function", "fa", "--action", "claim"}, "claim:worker-1"},
		{[]string{"--since", "1h"}, "discard:alice discard:bob purge:alice"},
		{[]string{"--until", "1h"}, ""},
		{[]string{"--limit", "2"}, "discard:bob purge:alice"},
	} {
		if got := actions(auditJSONOf(tc.args...)); got != tc.want {
			t.Errorf("kfn audit %q = %q, want %q", tc.args, got, tc.want)
		}
	}
	rows := auditJSONOf("--action", "purge")
	if len(rows) != 1 || rows[0].Partition != nil || rows[0].Reason != "older than 2h0m0s" || fmt.Sprint(rows[0].Details["count"]) != "1" {
		t.Errorf("purge row = %+v; want no partition, the reason and a count of 1", rows)
	}
	rows = auditJSONOf("--actor", "alice", "--action", "discard")
	if len(rows) != 1 || rows[0].Function != "fa" || rows[0].Topic != "ta" || rows[0].Partition == nil || *rows[0].Partition != 1 ||
		rows[0].Reason != "INC-3: resent by hand" || fmt.Sprint(rows[0].Details["dead_letter_id"]) != fmt.Sprint(id[1]) {
		t.Errorf("discard row = %+v", rows)
	}

	code, out, stderr := kfn(t, "audit", "--database-url", db.URL)
	t.Logf("$ kfn audit\n%s", out)
	if code != 0 || !strings.HasPrefix(out, "AT  ") || !strings.Contains(out, "ACTOR  ACTION   FUNCTION  TOPIC  PARTITION  REASON") ||
		!regexpMatch(`(?m)^\S+ \S+  alice +discard +fa +ta +1 +INC-3: resent by hand +attempts=5 dead_at="?\S+"? dead_letter_id=\d+ dead_letter_reason=handler_error error="insert: connection reset" offset=2$`, out) ||
		!regexpMatch(`(?m)^\S+ \S+  alice +purge +- +- +- +older than 2h0m0s +before=\S+ count=1 older_than=2h0m0s$`, out) {
		t.Errorf("kfn audit table: exit %d, out:\n%s\nerr %q", code, out, stderr)
	}
	code, _, stderr = kfn(t, "audit", "--database-url", db.URL, "--limit", "1")
	if code != 0 || !strings.Contains(stderr, "only the newest 1 shown; more match") {
		t.Errorf("kfn audit --limit 1: exit %d, stderr %q", code, stderr)
	}
	for _, args := range [][]string{{"--limit", "0"}, {"--since", "soon"}, {"stray"}} {
		if code, _, stderr := kfn(t, append([]string{"audit", "--database-url", db.URL}, args...)...); code != 2 || !strings.Contains(stderr, "(see kfn audit -h)") {
			t.Errorf("kfn audit %q: exit %d, stderr %q; want a usage error", args, code, stderr)
		}
	}
}

func regexpMatch(re, s string) bool { return regexp.MustCompile(re).MatchString(s) }
