package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/dlqtest"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// countRows counts rows of a query.
func countRows(t *testing.T, db *kfntest.PG, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// listedIDs runs kfn dlq list --json with args and returns the ids listed.
func listedIDs(t *testing.T, db *kfntest.PG, args ...string) []int64 {
	t.Helper()
	code, out, stderr := kfn(t, append([]string{"dlq", "list", "--database-url", db.URL, "--json"}, args...)...)
	var got []struct {
		ID int64 `json:"id"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &got) != nil {
		t.Fatalf("kfn dlq list %q: exit %d, out %q, err %q", args, code, out, stderr)
	}
	ids := []int64{}
	for _, d := range got {
		ids = append(ids, d.ID)
	}
	return ids
}

var fourLetters = []dlqtest.Letter{
	{Function: "fa", Topic: "ta", Partition: 0, Offset: 1, Reason: "permanent", Error: "permanent: decode JSON: bad", Age: 3 * time.Hour, Key: []byte("k1")},
	{Function: "fa", Topic: "ta", Partition: 1, Offset: 2, Reason: "handler_error", Error: "insert: connection reset", Age: 30 * time.Minute},
	{Function: "fa", Topic: "tb", Partition: 0, Offset: 3, Reason: "parked", Error: "parked by me: INC-1", Age: 10 * time.Minute},
	{Function: "fb", Topic: "ta", Partition: 0, Offset: 4, Reason: "permanent", Error: "permanent: decode JSON: worse", Age: 5 * time.Minute},
}

func TestDLQListFiltersNarrowTheList(t *testing.T) {
	db := kfntest.Postgres(t)
	id := dlqtest.Seed(t, db.Pool, fourLetters...)
	between := time.Now().Add(-time.Hour).UTC().Format(time.RFC3339)
	for _, tc := range []struct {
		args []string
		want []int64
	}{
		{nil, id},
		{[]string{"--function", "fa"}, id[:3]},
		{[]string{"--topic", "tb"}, id[2:3]},
		{[]string{"--partition", "1"}, id[1:2]},
		{[]string{"--partition", "0", "--topic", "ta"}, []int64{id[0], id[3]}},
		{[]string{"--reason", "permanent"}, []int64{id[0], id[3]}},
		{[]string{"--error", "decode JSON"}, []int64{id[0], id[3]}},
		{[]string{"--error", "DECODE"}, []int64{}},
		{[]string{"--error", "INC-1"}, id[2:3]},
		{[]string{"--since", "1h"}, id[1:]},
		{[]string{"--until", "1h"}, id[:1]},
		{[]string{"--since", between}, id[1:]},
		{[]string{"--since", "1h", "--until", "20m"}, id[1:2]},
		{[]string{"--function", "fa", "--reason", "permanent"}, id[:1]},
		{[]string{"--limit", "2"}, id[:2]},
	} {
		if got := listedIDs(t, db, tc.args...); !slices.Equal(got, tc.want) {
			t.Errorf("kfn dlq list %q = ids %v, want %v", tc.args, got, tc.want)
		}
	}
	// A filter that cannot match is a usage error that says what exists.
	for _, args := range [][]string{{"--function", "nobody"}, {"--topic", "ta", "--partition", "7"}} {
		code, _, stderr := kfn(t, append([]string{"dlq", "list", "--database-url", db.URL}, args...)...)
		if code != 2 || !strings.Contains(stderr, "use one of") {
			t.Errorf("kfn dlq list %q: exit %d, stderr %q; want exit 2 naming what exists", args, code, stderr)
		}
	}

	code, out, stderr := kfn(t, "dlq", "--database-url", db.URL, "--limit", "3")
	t.Logf("$ kfn dlq --limit 3\n%s%s", out, stderr)
	if code != 0 || !strings.HasPrefix(out, "ID  FUNCTION  TOPIC  PARTITION  OFFSET  REASON") || strings.Count(out, "\n") != 4 ||
		!strings.Contains(out, "permanent: decode JSON: bad") || !strings.Contains(stderr, "only the oldest 3 shown; more match") {
		t.Errorf("kfn dlq --limit 3: exit %d, out %q, err %q; want a table of 3 and a note that more match", code, out, stderr)
	}
	if code, _, stderr := kfn(t, "dlq", "--database-url", db.URL, "--limit", "4"); code != 0 || stderr != "" {
		t.Errorf("kfn dlq --limit 4 with 4 dead letters: exit %d, stderr %q; want no note", code, stderr)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--since", "yesterday"}, `--since "yesterday": neither an RFC 3339 time`},
		{[]string{"--until", "-2h"}, `--until "-2h": neither`},
		{[]string{"--since", "1h", "--until", "2h"}, "--since (" /* … */},
		{[]string{"--reason", "bad"}, `--reason "bad" is not a dead letter reason: use one of handler_error, permanent`},
		{[]string{"--partition", "-3"}, "--partition must be 0 or more"},
		{[]string{"--limit", "0"}, "--limit must be at least 1"},
	} {
		code, _, stderr := kfn(t, append([]string{"dlq", "list", "--database-url", db.URL}, tc.args...)...)
		if code != 2 || !strings.Contains(stderr, tc.want) || !strings.Contains(stderr, "kfn dlq list: ") || !strings.Contains(stderr, "(see kfn dlq list -h)") {
			t.Errorf("kfn dlq list %q: exit %d, stderr %q; want exit 2 and %q", tc.args, code, stderr, tc.want)
		}
	}
}

func TestDLQShowPrintsTheWholeRecordAsTextOrHex(t *testing.T) {
	db := kfntest.Postgres(t)
	value := bytes.Repeat([]byte{0x00, 0xff, 0x1b}, 20) // 60 bytes: two hex lines
	id := dlqtest.Seed(t, db.Pool,
		dlqtest.Letter{Function: "fa", Topic: "ta", Partition: 2, Offset: 7, Reason: "permanent", Error: "permanent: decode: bad\nsecond line \x1b[2J",
			Key: []byte("order-7"), Value: []byte("{\"a\": 1}\n\tnext line ✓"), Headers: []inbox.Header{{Key: []byte("trace"), Value: []byte("abc")}, {Key: []byte("nul"), Value: nil}}},
		dlqtest.Letter{Function: "fa", Topic: "ta", Partition: 2, Offset: 8, Reason: "handler_error", Error: "boom",
			Key: []byte{0x00, 0xff}, Value: value, Headers: []inbox.Header{{Key: []byte("bin\x00"), Value: []byte("a\rb")}, {Key: []byte("empty"), Value: []byte{}}}},
		dlqtest.Letter{Function: "fa", Topic: "ta", Partition: 2, Offset: 9, Reason: "data_error", Error: "refused", Raw: true,
			Key: []byte("raw-key"), Value: []byte{0xc3, 0x28}, Headers: []inbox.Header{{Key: []byte("h"), Value: []byte("v")}}},
	)
	show := func(args ...string) string {
		t.Helper()
		code, out, stderr := kfn(t, append([]string{"dlq", "show", "--database-url", db.URL}, args...)...)
		if code != 0 {
			t.Fatalf("kfn dlq show %q: exit %d, err %q", args, code, stderr)
		}
		return out
	}
	text := show(fmt.Sprint(id[0]))
	t.Logf("$ kfn dlq show %d\n%s", id[0], text)
	for _, want := range []string{
		fmt.Sprintf("id           %d\n", id[0]), "function     fa\n", "topic        ta\n", "partition    2\n", "offset       7\n", "reason       permanent\n",
		"attempts     5\n", "dead at      20", "record time  2026-03-01T09:00:00Z\n",
		"error:\n  permanent: decode: bad\n  second line \\x1b[2J\n",
		"key (text, 7 bytes):\n  order-7\n",
		"value (text, 23 bytes):\n  {\"a\": 1}\n  \tnext line ✓\n",
		"header 1 name (text, 5 bytes):\n  trace\nheader 1 value (text, 3 bytes):\n  abc\n",
		"header 2 name (text, 3 bytes):\n  nul\nheader 2 value: null\n",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("kfn dlq show (text) lacks %q", want)
		}
	}
	if strings.Contains(text, "\x1b") || strings.Contains(text, "stored ") {
		t.Errorf("kfn dlq show (text) printed an escape character or a raw-blob note:\n%q", text)
	}

	binary := show(fmt.Sprint(id[1]))
	t.Logf("$ kfn dlq show %d\n%s", id[1], binary)
	hexValue := strings.Repeat("00ff1b", 20)
	for _, want := range []string{
		"key (hex, 2 bytes):\n  00ff\n",
		"value (hex, 60 bytes):\n  " + hexValue[:64] + "\n  " + hexValue[64:] + "\n",
		"header 1 name (hex, 4 bytes):\n  62696e00\nheader 1 value (hex, 3 bytes):\n  610d62\n",
		"header 2 name (text, 5 bytes):\n  empty\nheader 2 value: empty (0 bytes)\n",
	} {
		if !strings.Contains(binary, want) {
			t.Errorf("kfn dlq show (binary) lacks %q", want)
		}
	}

	raw := show(fmt.Sprint(id[2]))
	t.Logf("$ kfn dlq show %d\n%s", id[2], raw)
	for _, want := range []string{"stored       as one raw blob", "key (text, 7 bytes):\n  raw-key\n", "value (hex, 2 bytes):\n  c328\n",
		"header 1 name (text, 1 byte):\n  h\nheader 1 value (text, 1 byte):\n  v\n"} {
		if !strings.Contains(raw, want) {
			t.Errorf("kfn dlq show (raw blob) lacks %q", want)
		}
	}

	var got deadLetterWhole
	if err := json.Unmarshal([]byte(show(fmt.Sprint(id[1]), "--json")), &got); err != nil {
		t.Fatal(err)
	}
	if got.ID != id[1] || got.Function != "fa" || got.Offset != 8 || !bytes.Equal(got.Key, []byte{0, 0xff}) || !bytes.Equal(got.Value, value) ||
		len(got.Headers) != 2 || !bytes.Equal(got.Headers[0].Key, []byte("bin\x00")) || !bytes.Equal(got.Headers[0].Value, []byte("a\rb")) ||
		got.Headers[1].Value == nil || got.RecordTime == nil || got.StoredRaw {
		t.Errorf("kfn dlq show --json = %+v; want every byte back", got)
	}
	if err := json.Unmarshal([]byte(show(fmt.Sprint(id[2]), "--json")), &got); err != nil || !got.StoredRaw || string(got.Key) != "raw-key" || !bytes.Equal(got.Value, []byte{0xc3, 0x28}) {
		t.Errorf("kfn dlq show --json of the raw blob = %+v, %v; want it decoded", got, err)
	}

	if code, _, stderr := kfn(t, "dlq", "show", "--database-url", db.URL, "999"); code != 1 || !strings.Contains(stderr, "kfn dlq show: no dead letter 999 (discarded or purged already? kfn dlq list shows the ids)") {
		t.Errorf("show 999: exit %d, stderr %q; want exit 1 and what to do", code, stderr)
	}
	for _, args := range [][]string{{"abc"}, {}, {"1", "2"}} {
		if code, _, stderr := kfn(t, append([]string{"dlq", "show", "--database-url", db.URL}, args...)...); code != 2 || !strings.Contains(stderr, "(see kfn dlq show -h)") {
			t.Errorf("show %q: exit %d, stderr %q; want a usage error", args, code, stderr)
		}
	}
}

// auditRows are the audit rows of an action, as (consumer, actor, details).
func auditRows(t *testing.T, db *kfntest.PG, action string) []string {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT consumer || '/' || partition || ' ' || actor || ' ' || details::text FROM kfn.audit_log WHERE action = $1 ORDER BY id`, action)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestDLQDiscardDeletesForGoodAudited(t *testing.T) {
	db := kfntest.Postgres(t)
	id := dlqtest.Seed(t, db.Pool, fourLetters...)
	base := []string{"dlq", "discard", "--database-url", db.URL}
	unchanged := func(what string) {
		t.Helper()
		if n := countRows(t, db, `SELECT count(*) FROM kfn.dead_letters`); n != 4 {
			t.Fatalf("%s: %d dead letters, want all 4 still there", what, n)
		}
		if n := countRows(t, db, `SELECT count(*) FROM kfn.audit_log WHERE action = 'discard'`); n != 0 {
			t.Fatalf("%s: %d discard audit rows, want none", what, n)
		}
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--function", "fa"}, `--reason is required: say why, for the audit log`},
		{[]string{"--reason", "cleanup"}, "this would discard every dead letter: give ids or a filter (--function, --dead-reason, --until …), or say --all"},
		{[]string{"--function", "fa", "--reason", "permanent"}, "--reason is why you discard, for the audit log; to select the dead letters whose reason is permanent, use --dead-reason permanent"},
		{[]string{fmt.Sprint(id[0]), "--topic", "ta", "--reason", "x"}, "give ids (and their --function) or filters, not both"},
		{[]string{"x1", "--reason", "x"}, `"x1" is not a dead letter id`},
	} {
		code, _, stderr := kfn(t, append(base, tc.args...)...)
		if code != 2 || !strings.Contains(stderr, tc.want) || !strings.Contains(stderr, "(see kfn dlq discard -h)") {
			t.Errorf("kfn dlq discard %q: exit %d, stderr %q; want exit 2 and %q", tc.args, code, stderr, tc.want)
		}
	}
	unchanged("refused discards")

	code, out, stderr := kfn(t, append(base, "--function", "fa", "--dead-reason", "permanent", "--reason", "bad producer", "--dry-run")...)
	t.Logf("$ kfn dlq discard --function fa --dead-reason permanent --reason \"bad producer\" --dry-run\n%s", out)
	if code != 0 || strings.Count(out, "\n") != 3 || !strings.Contains(out, "permanent: decode JSON: bad") || !strings.Contains(out, "dry run: 1 dead letter would be discarded; nothing changed") {
		t.Errorf("dry run: exit %d, out %q, err %q", code, out, stderr)
	}
	code, out, _ = kfn(t, append(base, "--error", "decode JSON", "--reason", "x", "--dry-run", "--json")...)
	var dry struct {
		DryRun      bool `json:"dry_run"`
		Count       int  `json:"count"`
		DeadLetters []struct {
			ID int64 `json:"id"`
		} `json:"dead_letters"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &dry) != nil || !dry.DryRun || dry.Count != 2 || len(dry.DeadLetters) != 2 || dry.DeadLetters[1].ID != id[3] {
		t.Errorf("dry run --json: exit %d, out %q", code, out)
	}
	unchanged("dry runs")

	code, _, stderr = kfn(t, append(base, fmt.Sprint(id[1]), "999", "--reason", "x")...)
	if code != 1 || !strings.Contains(stderr, "kfn dlq discard: no dead letter 999") {
		t.Errorf("discard of a missing id: exit %d, stderr %q; want exit 1 naming it", code, stderr)
	}
	unchanged("a discard naming a missing id")

	code, out, stderr = kfn(t, append(base, "--reason", "INC-9: bad producer, fixed in v2", "--actor", "alice", "--error", "decode JSON")...)
	t.Logf("$ kfn dlq discard --error \"decode JSON\" --reason … --actor alice\n%s", out)
	if code != 0 || !strings.Contains(out, "discarded 2 dead letters for good, audited as alice (INC-9: bad producer, fixed in v2)") {
		t.Fatalf("discard: exit %d, out %q, err %q", code, out, stderr)
	}
	code, out, stderr = kfn(t, append(base, fmt.Sprint(id[2]), "--reason", "parked by mistake")...)
	if code != 0 || !strings.Contains(out, "discarded 1 dead letter for good, audited as kfn-dlq-discard:") {
		t.Fatalf("discard by id: exit %d, out %q, err %q", code, out, stderr)
	}
	if got := listedIDs(t, db); !slices.Equal(got, id[1:2]) {
		t.Errorf("dead letters left = %v, want only %d", got, id[1])
	}
	audit := auditRows(t, db, "discard")
	if len(audit) != 3 {
		t.Fatalf("discard audit rows = %q; want one per dead letter", audit)
	}
	for i, want := range [][]string{
		{"fa/0 alice ", `"reason": "INC-9: bad producer, fixed in v2"`, fmt.Sprintf(`"dead_letter_id": %d`, id[0]), `"offset": 1`, `"dead_letter_reason": "permanent"`, `"error": "permanent: decode JSON: bad"`},
		{"fb/0 alice ", fmt.Sprintf(`"dead_letter_id": %d`, id[3]), `"offset": 4`},
		{"fa/0 kfn-dlq-discard:", `"reason": "parked by mistake"`, fmt.Sprintf(`"dead_letter_id": %d`, id[2]), `"dead_letter_reason": "parked"`},
	} {
		for _, w := range want {
			if !strings.Contains(audit[i], w) {
				t.Errorf("audit row %d = %q; want %q in it", i, audit[i], w)
			}
		}
	}
	// Nothing re-applies a discarded record: it stays handled.
	if n := countRows(t, db, `SELECT count(*) FROM kfn.inbox WHERE outcome = 'dead_lettered'`); n != 4 {
		t.Errorf("inbox rows still dead_lettered = %d, want all 4", n)
	}
	code, out, _ = kfn(t, append(base, "--function", "fa", "--error", "nothing like this", "--reason", "x")...)
	if code != 0 || out != "no dead letter matches: nothing discarded\n" {
		t.Errorf("discard matching nothing: exit %d, out %q", code, out)
	}
	if code, _, stderr := kfn(t, append(base, "--function", "nobody", "--reason", "x")...); code != 2 || !strings.Contains(stderr, `--function "nobody": no function`) {
		t.Errorf("discard of a function kfn never saw: exit %d, stderr %q; want exit 2", code, stderr)
	}
	code, out, stderr = kfn(t, append(base, "--all", "--reason", "wipe the test data")...)
	if code != 0 || !strings.Contains(out, "discarded 1 dead letter") || countRows(t, db, `SELECT count(*) FROM kfn.dead_letters`) != 0 {
		t.Errorf("discard --all: exit %d, out %q, err %q", code, out, stderr)
	}
}

func TestDLQPurgeDeletesTheOlderOnesAuditedAsOneRow(t *testing.T) {
	db := kfntest.Postgres(t)
	id := dlqtest.Seed(t, db.Pool,
		dlqtest.Letter{Function: "fa", Topic: "ta", Offset: 1, Reason: "permanent", Error: "old", Age: 40 * 24 * time.Hour},
		dlqtest.Letter{Function: "fb", Topic: "ta", Offset: 2, Reason: "permanent", Error: "old too", Age: 31 * 24 * time.Hour},
		dlqtest.Letter{Function: "fa", Topic: "ta", Offset: 3, Reason: "permanent", Error: "recent", Age: 10 * 24 * time.Hour},
		dlqtest.Letter{Function: "fa", Topic: "ta", Offset: 4, Reason: "permanent", Error: "new", Age: time.Minute},
	)
	base := []string{"dlq", "purge", "--database-url", db.URL}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "--older-than is required: how old a dead letter must be to go, e.g. 30d"},
		{[]string{"--older-than", "0s"}, "--older-than 0s must be positive"},
		{[]string{"--older-than", "30x"}, `--older-than "30x": not a duration (90m, 2h, 7d)`},
	} {
		if code, _, stderr := kfn(t, append(base, tc.args...)...); code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("kfn dlq purge %q: exit %d, stderr %q; want exit 2 and %q", tc.args, code, stderr, tc.want)
		}
	}
	code, out, stderr := kfn(t, append(base, "--older-than", "720h", "--dry-run")...)
	if code != 0 || !strings.HasPrefix(out, "dry run: 2 dead letters would be purged (dead-lettered before ") || len(listedIDs(t, db)) != 4 || len(auditRows(t, db, "purge")) != 0 {
		t.Errorf("purge --dry-run: exit %d, out %q, err %q; want a count and no change", code, out, stderr)
	}
	code, out, stderr = kfn(t, append(base, "--older-than", "720h", "--actor", "ops-bot")...)
	t.Logf("$ kfn dlq purge --older-than 720h --actor ops-bot\n%s", out)
	if code != 0 || !strings.HasPrefix(out, "purged 2 dead letters (dead-lettered before ") || !strings.HasSuffix(out, ", audited as ops-bot\n") {
		t.Fatalf("purge: exit %d, out %q, err %q", code, out, stderr)
	}
	if got := listedIDs(t, db); !slices.Equal(got, id[2:]) {
		t.Errorf("dead letters left = %v, want %v", got, id[2:])
	}
	if audit := auditRows(t, db, "purge"); len(audit) != 1 || !strings.HasPrefix(audit[0], "/-1 ops-bot ") || !strings.Contains(audit[0], `"count": 2`) ||
		!strings.Contains(audit[0], `"older_than": "720h0m0s"`) || !strings.Contains(audit[0], `"reason": "older than 720h0m0s"`) {
		t.Errorf("purge audit rows = %q; want one with the count", audit)
	}
	if n := countRows(t, db, `SELECT count(*) FROM kfn.inbox WHERE outcome = 'dead_lettered'`); n != 4 {
		t.Errorf("inbox rows still dead_lettered = %d, want all 4", n)
	}
	code, out, _ = kfn(t, append(base, "--older-than", "720h", "--json")...)
	var res struct {
		DryRun bool      `json:"dry_run"`
		Count  int64     `json:"count"`
		Before time.Time `json:"before"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &res) != nil || res.Count != 0 || res.DryRun || time.Since(res.Before) < 719*time.Hour {
		t.Errorf("purge again --json: exit %d, out %q; want count 0", code, out)
	}
	if audit := auditRows(t, db, "purge"); len(audit) != 1 {
		t.Errorf("a purge that deleted nothing wrote an audit row: %q", audit)
	}
}

// Every command that reads kfn's tables says what to do when the schema is
// not there, and exits 1.
func TestAMissingSchemaAsksForMigrate(t *testing.T) {
	db := kfntest.PostgresEmpty(t)
	for _, args := range [][]string{
		{"dlq"}, {"dlq", "show", "1"}, {"dlq", "discard", "1", "--reason", "x"}, {"dlq", "purge", "--older-than", "1h"}, {"audit"}, {"status"},
	} {
		code, _, stderr := kfn(t, append(args, "--database-url", db.URL)...)
		if code != 1 || !strings.HasSuffix(stderr, ": the kfn schema is missing in this database: run `kfn migrate`\n") {
			t.Errorf("kfn %q on an empty database: exit %d, stderr %q; want exit 1 asking for kfn migrate", args, code, stderr)
		}
	}
	if code, _, _ := kfn(t, "migrate", "--database-url", db.URL); code != 0 {
		t.Fatal("migrate failed")
	}
	if code, out, stderr := kfn(t, "dlq", "--database-url", db.URL); code != 0 || strings.Count(out, "\n") != 1 {
		t.Errorf("kfn dlq after kfn migrate: exit %d, out %q, err %q; want an empty table", code, out, stderr)
	}
}

func TestDLQAndAuditExitCodes(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"dlq", "-h"}, 0, "kfn dlq show ID"},
		{[]string{"dlq", "list", "-h"}, 0, "examples:"},
		{[]string{"dlq", "show", "-h"}, 0, "examples:"},
		{[]string{"dlq", "discard", "-h"}, 0, "examples:"},
		{[]string{"dlq", "purge", "-h"}, 0, "examples:"},
		{[]string{"audit", "-h"}, 0, "shown only with --action claim"},
		{[]string{"dlq", "bogus"}, 2, `kfn dlq: unknown dlq command "bogus": use list, show, discard, purge, park or retry`},
		{[]string{"dlq", "show", "1"}, 2, "kfn dlq show: --database-url is required (or set DATABASE_URL)"},
		{[]string{"audit", "--database-url", "postgres://postgres@127.0.0.1:1/x?connect_timeout=2"}, 1, "kfn audit: cannot reach Postgres"},
		{[]string{"dlq", "purge", "--older-than", "1h", "--database-url", "postgres://postgres@127.0.0.1:1/x?connect_timeout=2"}, 1, "kfn dlq purge: cannot reach Postgres"},
	} {
		t.Setenv("DATABASE_URL", "")
		code, stdout, stderr := kfn(t, tc.args...)
		if tc.code == 0 {
			stderr = stdout // help goes to stdout
		}
		if code != tc.code || !strings.Contains(stderr, tc.want) {
			t.Errorf("kfn %q: exit %d, stderr %q; want exit %d and %q", tc.args, code, stderr, tc.code, tc.want)
		}
	}
}

// A discarded dead letter stays handled: when a replay takes a running
// worker back over it, the worker skips it with the records around it and
// neither applies nor dead-letters it again.
func TestDLQDiscardedRecordIsNotAppliedAgain(t *testing.T) {
	db := kfntest.Postgres(t)
	k := kfntest.Kafka(t)
	natsURL := kfntest.NATSURL(t)
	bucket := kfntest.Name(t, "leases")
	topic := k.CreateTopic(t, 1)
	fn := orders.Function()
	fn.Name, fn.Topic = kfntest.Name(t, "orders"), topic
	var msgs []kafka.Message
	for i := 1; i <= 4; i++ {
		key, value := validOrder(i)
		msgs = append(msgs, kafka.Message{Key: []byte(key), Value: value})
	}
	msgs = slices.Insert(msgs, 1, kafka.Message{Key: []byte("bad"), Value: []byte("{not json")}) // offset 1
	k.Produce(t, topic, msgs...)

	w, _ := startWorker(t, operatorTestConfig(k, db.URL, natsURL, bucket), fn)
	cursor := func() int {
		return countRows(t, db, `SELECT coalesce(max(next_offset), -1) FROM kfn.cursors WHERE consumer = $1`, fn.Name)
	}
	// The worker counts a batch just after its commit: wait for both.
	waitFor(t, "the cursor to reach 5 and the bad order to be counted", func() bool { return cursor() == 5 && w.Stats().DeadLettered.Load() >= 1 })
	dead := listedIDs(t, db, "--function", fn.Name)
	if len(dead) != 1 || w.Stats().DeadLettered.Load() != 1 {
		t.Fatalf("dead letters %v, dead-lettered %d; want the one bad order", dead, w.Stats().DeadLettered.Load())
	}
	code, out, stderr := kfn(t, "dlq", "discard", "--database-url", db.URL, fmt.Sprint(dead[0]), "--reason", "test: not to be re-driven")
	if code != 0 || !strings.Contains(out, "discarded 1 dead letter") {
		t.Fatalf("discard: exit %d, out %q, err %q", code, out, stderr)
	}

	duplicates := w.Stats().Duplicates.Load()
	code, out, stderr = kfn(t, "replay", "--database-url", db.URL, "--nats-url", natsURL, "--lease-bucket", bucket, "--function", fn.Name,
		"--topic", topic, "--partition", "0", "--from-offset", "0", "--kafka-brokers", strings.Join(k.Brokers, ","))
	if code != 0 || !strings.Contains(out, "cursor 5 -> 0 (idempotent") {
		t.Fatalf("replay: exit %d, out %q, err %q", code, out, stderr)
	}
	waitFor(t, "the worker to read the 5 records again", func() bool { return cursor() == 5 && w.Stats().Duplicates.Load() == duplicates+5 })
	if n := countRows(t, db, `SELECT count(*) FROM kfn.dead_letters WHERE consumer = $1`, fn.Name); n != 0 || w.Stats().DeadLettered.Load() != 1 {
		t.Errorf("after the replay: %d dead letters, %d dead-lettered in all; want the discarded record not dead-lettered again", n, w.Stats().DeadLettered.Load())
	}
	if n := countRows(t, db, `SELECT count(*) FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = $1 AND "offset" = 1 AND outcome = 'dead_lettered'`, fn.Name); n != 1 {
		t.Errorf("inbox row of the discarded record: %d dead_lettered rows, want 1", n)
	}
	if n := countRows(t, db, `SELECT coalesce(sum(revisions), 0) FROM orders`); n != 4 || w.Stats().Applied.Load() != 4 {
		t.Errorf("orders revisions %d, applied %d; want 4 and 4: nothing applied again", n, w.Stats().Applied.Load())
	}
}
