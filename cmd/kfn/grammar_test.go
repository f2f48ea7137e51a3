package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/devstack"
	"github.com/kfn-dev/kfn/internal/dlqtest"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// grammarEnv is what the commands of TestEveryCommandSpeaksOneGrammar run
// against: real services, a function f with cursors on two partitions of
// a topic, one dead letter, one event in the stream.
type grammarEnv struct {
	db, wrongPW, nats, topic, fn, subject, stream, bucket string
	brokers                                               string
	letter                                                int64
	consoleUsers                                          string // an auth file for kfn console
}

// grammarSpec says how one command is walked through the cases.
type grammarSpec struct {
	base     func(e grammarEnv) []string // a valid invocation, against e
	badValue []string                    // a flag and a value it refuses
	timeFlag string                      // its time flag, if any
	json     func(e grammarEnv) []string // an invocation with --json; nil: prints no data
	filter   []string                    // a filter value that cannot match (appended to base)
	pg, nats bool                        // it connects to Postgres, to NATS
	kafka    bool                        // it connects to Kafka (and to nothing else)
	// jsonCode is the exit code of the --json run, connectCode of a run
	// that cannot connect (kfn verify: 1 is a violation found, 2 could
	// not check).
	jsonCode, connectCode int
}

func grammarSpecs() map[string]grammarSpec {
	pg := func(e grammarEnv) []string { return []string{"--database-url", e.db} }
	pgNATS := func(e grammarEnv) []string {
		return []string{"--database-url", e.db, "--nats-url", e.nats, "--lease-bucket", e.bucket}
	}
	with := func(base func(grammarEnv) []string, more ...string) func(grammarEnv) []string {
		return func(e grammarEnv) []string { return append(base(e), more...) }
	}
	return map[string]grammarSpec{
		"dev":     {badValue: []string{"--rate", "fast"}},
		"new":     {badValue: []string{"--no-tidy=perhaps", ""}},
		"bench":   {badValue: []string{"--records", "lots"}},
		"version": {badValue: []string{"--no-such-flag-value", "x"}},
		"migrate": {base: pg, badValue: []string{"--nats=maybe", ""}, pg: true},
		"status": {base: pg, badValue: []string{"--watch", "often"}, pg: true,
			json: func(e grammarEnv) []string {
				return []string{"--database-url", e.db, "--function", e.fn, "--kafka-brokers", e.brokers, "--json"}
			},
			filter: []string{"--function", "nosuch"}},
		"replay": {
			base: func(e grammarEnv) []string {
				return with(pgNATS, "--kafka-brokers", e.brokers, "--function", e.fn, "--topic", e.topic, "--from-offset", "0")(e)
			},
			badValue: []string{"--from-offset", "ten"}, timeFlag: "from-time", pg: true, nats: true,
			json: func(e grammarEnv) []string {
				return with(pgNATS, "--kafka-brokers", e.brokers, "--function", e.fn, "--topic", e.topic, "--from-time", "30d", "--dry-run", "--json")(e)
			},
			filter: []string{"--partition", "7"}},
		"dlq":      {base: pg, badValue: []string{"--limit", "x"}, timeFlag: "since", pg: true, json: with(pg, "--json"), filter: []string{"--function", "nosuch"}},
		"dlq list": {base: pg, badValue: []string{"--partition", "x"}, timeFlag: "until", pg: true, json: with(pg, "--json"), filter: []string{"--reason", "bogus"}},
		"dlq show": {base: func(e grammarEnv) []string { return append(pg(e), fmt.Sprint(e.letter)) }, badValue: []string{"--json=maybe", ""}, pg: true,
			json: func(e grammarEnv) []string { return append(pg(e), fmt.Sprint(e.letter), "--json") }},
		"dlq discard": {base: func(e grammarEnv) []string {
			return append(pg(e), "--function", e.fn, "--reason", "grammar test", "--dry-run")
		}, badValue: []string{"--limit", "x"}, timeFlag: "since", pg: true,
			json: func(e grammarEnv) []string {
				return append(pg(e), "--function", e.fn, "--reason", "grammar test", "--dry-run", "--json")
			},
			filter: []string{"--function", "nosuch"}},
		"dlq purge": {base: with(pg, "--older-than", "30d"), badValue: []string{"--older-than", "old"}, pg: true,
			json: with(pg, "--older-than", "30d", "--dry-run", "--json")},
		"dlq park": {base: func(e grammarEnv) []string {
			return with(pgNATS, "--kafka-brokers", e.brokers, "--function", e.fn, "--topic", e.topic, "--partition", "0", "--offset", "2", "--reason", "grammar test")(e)
		}, badValue: []string{"--offset", "x"}, pg: true, nats: true,
			json: func(e grammarEnv) []string {
				return with(pgNATS, "--kafka-brokers", e.brokers, "--function", e.fn, "--topic", e.topic, "--partition", "1", "--offset", "2", "--reason", "grammar test", "--json")(e)
			},
			filter: []string{"--function", "nosuch"}},
		"dlq retry": {base: func(e grammarEnv) []string { return append(pg(e), "--function", e.fn, "--reason", "grammar test") },
			badValue: []string{"--limit", "x"}, pg: true,
			json: func(e grammarEnv) []string {
				return append(pg(e), "--function", e.fn, "--reason", "grammar test", "--json")
			},
			filter: []string{"--dead-reason", "bogus"}},
		"audit": {base: pg, badValue: []string{"--limit", "x"}, timeFlag: "since", pg: true, json: with(pg, "--json"), filter: []string{"--action", "bogus"}},
		"relay": {base: func(e grammarEnv) []string {
			return with(pgNATS, "--subjects", e.subject)(e)
		}, badValue: []string{"--stats-every", "often"}, pg: true, nats: true},
		"topic":        {badValue: []string{"--no-such-flag-value", "x"}},
		"topic create": {base: func(e grammarEnv) []string { return []string{"grammar-new", "--kafka-brokers", e.brokers} }, badValue: []string{"--partitions", "x"}, kafka: true},
		"topic list": {base: func(e grammarEnv) []string { return []string{"--kafka-brokers", e.brokers} }, badValue: []string{"--json=maybe", ""}, kafka: true,
			json: func(e grammarEnv) []string { return []string{"--kafka-brokers", e.brokers, "--json"} }},
		"topic describe": {base: func(e grammarEnv) []string { return []string{e.topic, "--kafka-brokers", e.brokers} }, badValue: []string{"--json=maybe", ""}, kafka: true,
			json: func(e grammarEnv) []string { return []string{e.topic, "--kafka-brokers", e.brokers, "--json"} }},
		"produce": {base: func(e grammarEnv) []string { return []string{e.topic, "--kafka-brokers", e.brokers, "--value", "v"} }, badValue: []string{"--partition", "x"}, kafka: true,
			json: func(e grammarEnv) []string {
				return []string{e.topic, "--kafka-brokers", e.brokers, "--key", "k", "--value", "v", "--json"}
			}},
		"tail": {base: func(e grammarEnv) []string {
			return []string{e.subject, "--nats-url", e.nats, "--event-stream", e.stream, "--all", "--count", "1"}
		},
			badValue: []string{"--count", "x"}, nats: true,
			json: func(e grammarEnv) []string {
				return []string{e.subject, "--nats-url", e.nats, "--event-stream", e.stream, "--all", "--count", "1", "--json"}
			}},
		// Started right, kfn console serves until stopped: the grammar walks
		// only its refusals (its serving is TestConsoleServesItsLoginPageUntilStopped's).
		"console": {base: func(e grammarEnv) []string {
			return []string{"--database-url", e.db, "--auth-file", e.consoleUsers, "--listen", "127.0.0.1:0"}
		}, badValue: []string{"--allow-writes=maybe", ""}, pg: true},
		"verify": {base: func(e grammarEnv) []string {
			return []string{"--database-url", e.db, "--function", e.fn, "--topic", e.topic, "--kafka-brokers", e.brokers}
		}, badValue: []string{"--unpublished-after", "soon"}, pg: true, jsonCode: 1, connectCode: 2,
			json: func(e grammarEnv) []string {
				return []string{"--database-url", e.db, "--function", e.fn, "--topic", e.topic, "--kafka-brokers", e.brokers, "--json"}
			}},
	}
}

// allCommands lists every command and subcommand from main.go's dispatch.
func allCommands() []string {
	var names []string
	for n := range commands {
		names = append(names, n)
	}
	for n := range dlqCommands {
		names = append(names, "dlq "+n)
	}
	for n := range topicCommands {
		names = append(names, "topic "+n)
	}
	sort.Strings(names)
	return names
}

// TestEveryCommandSpeaksOneGrammar walks every kfn command, from main.go's
// dispatch, through help, a bad value, an unknown flag, a bad time, --json,
// a filter that cannot match, a wrong Postgres password and an unreachable
// service, against real services, and checks the exit code and the first
// line of the output. It logs the table of results.
func TestEveryCommandSpeaksOneGrammar(t *testing.T) {
	e := grammarSetup(t)
	specs := grammarSpecs()
	docs := documentedJSON(t)
	type row struct{ cmd, kase, exit, first string }
	var rows []row
	check := func(cmd, kase string, args []string, wantCode int, wantFirst string, wantStdout bool) (string, bool) {
		t.Helper()
		code, stdout, stderr := kfn(t, args...)
		out := stderr
		if wantStdout {
			out = stdout
		}
		first, _, _ := strings.Cut(out, "\n")
		rows = append(rows, row{cmd, kase, fmt.Sprint(code), first})
		ok := code == wantCode && strings.HasPrefix(first, wantFirst)
		if !ok {
			t.Errorf("kfn %s (%s): exit %d, first line %q; want exit %d and a line starting %q\nstdout: %.400s\nstderr: %.400s", cmd, kase, code, first, wantCode, wantFirst, stdout, stderr)
		}
		if wantCode == 2 && kase != "wrong password" && kase != "unreachable" && strings.Count(strings.TrimSpace(stderr), "\n") > 0 {
			t.Errorf("kfn %s (%s): a usage error of more than one line:\n%s", cmd, kase, stderr)
		}
		return stdout, ok
	}
	for _, name := range allCommands() {
		spec, ok := specs[name]
		if !ok {
			t.Errorf("kfn %s has no grammar spec in grammar_test.go: add one", name)
			continue
		}
		path := strings.Fields(name)
		base := []string{}
		if spec.base != nil {
			base = spec.base(e)
		}
		cmd := func(more ...string) []string { return append(append(slices.Clone(path), base...), more...) }

		check(name, "help", append(slices.Clone(path), "-h"), 0, "usage: kfn "+path[0], true)
		check(name, "unknown flag", cmd("--no-such-flag"), 2, "kfn "+name+": unknown flag --no-such-flag", false)
		switch flagName, value, inline := strings.Cut(spec.badValue[0], "="); {
		case spec.badValue[0] == "--no-such-flag-value":
			// no flag with a typed value
		case inline:
			check(name, "bad value", cmd(spec.badValue[0]), 2, fmt.Sprintf("kfn %s: %s %q: ", name, flagName, value), false)
		default:
			check(name, "bad value", cmd(spec.badValue...), 2, fmt.Sprintf("kfn %s: %s %q: ", name, spec.badValue[0], spec.badValue[1]), false)
		}
		if spec.timeFlag != "" {
			check(name, "bad time", cmd("--"+spec.timeFlag, "yesterday"), 2, fmt.Sprintf(`kfn %s: --%s "yesterday": neither an RFC 3339 time`, name, spec.timeFlag), false)
		}
		if spec.filter != nil {
			check(name, "unknown filter", cmd(spec.filter...), 2, "kfn "+name+": ", false)
		}
		if spec.json != nil {
			stdout, ok := check(name, "--json", append(slices.Clone(path), spec.json(e)...), spec.jsonCode, "", true)
			if ok {
				checkDocumentedJSON(t, name, stdout, docs[name])
			}
		}
		connectCode := 1
		if spec.connectCode != 0 {
			connectCode = spec.connectCode
		}
		if spec.pg {
			args := cmd()
			i := slices.Index(args, "--database-url")
			args[i+1] = e.wrongPW
			check(name, "wrong password", args, connectCode, fmt.Sprintf(`kfn %s: Postgres at %s refused user "alice": wrong password`, name, hostPort(e.wrongPW)), false)
			args = cmd()
			args[i+1] = "postgres://kfn@127.0.0.1:1/kfn?connect_timeout=2"
			check(name, "unreachable", args, connectCode, "kfn "+name+": cannot reach Postgres at postgres://kfn@127.0.0.1:1/kfn?connect_timeout=2: connection refused", false)
		}
		if spec.nats && !spec.pg || name == "relay" {
			args := cmd()
			i := slices.Index(args, "--nats-url")
			args[i+1] = "nats://127.0.0.1:1"
			check(name, "NATS unreachable", args, 1, "kfn "+name+": cannot reach NATS at nats://127.0.0.1:1: connection refused", false)
		}
		if spec.kafka {
			args := cmd()
			i := slices.Index(args, "--kafka-brokers")
			args[i+1] = "127.0.0.1:1"
			check(name, "Kafka unreachable", args, 1, "kfn "+name+": ", false)
			if first := rows[len(rows)-1].first; !strings.Contains(first, "cannot reach Kafka at 127.0.0.1:1: connection refused") {
				t.Errorf("kfn %s with Kafka unreachable does not say so: %q", name, first)
			}
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n| command | case | exit | first line |\n|---|---|---|---|\n")
	for _, r := range rows {
		first := r.first
		if r := []rune(first); len(r) > 110 {
			first = string(r[:110]) + "…"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | `%s` |\n", r.cmd, r.kase, r.exit, strings.ReplaceAll(first, "|", "\\|"))
	}
	t.Log(b.String())
}

func hostPort(u string) string {
	at := strings.Index(u, "@")
	rest := u[at+1:]
	return rest[:strings.Index(rest, "/")]
}

// grammarSetup starts the services and the data the commands read.
func grammarSetup(t *testing.T) grammarEnv {
	t.Helper()
	db := kfntest.Postgres(t)
	k := kfntest.Kafka(t)
	e := grammarEnv{db: db.URL, nats: kfntest.NATSURL(t), topic: k.CreateTopic(t, 2), fn: kfntest.Name(t, "fn"),
		bucket: kfntest.Name(t, "leases"), stream: kfntest.Name(t, "EVENTS"), brokers: strings.Join(k.Brokers, ",")}
	e.subject = kfntest.Name(t, "ev") + ".made"
	var msgs []kafka.Message
	for p := 0; p < 2; p++ {
		for i := 0; i < 4; i++ {
			msgs = append(msgs, kafka.Message{Partition: p, Key: []byte(fmt.Sprint(i)), Value: []byte("v")})
		}
	}
	k.Produce(t, e.topic, msgs...)
	ctx := context.Background()
	for p := 0; p < 2; p++ {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO kfn.cursors (consumer, topic, partition, next_offset, high_water, epoch, owner) VALUES ($1, $2, $3, 2, 2, 1, 'grammar')`, e.fn, e.topic, p); err != nil {
			t.Fatal(err)
		}
	}
	e.letter = dlqtest.Seed(t, db.Pool, dlqtest.Letter{Function: e.fn, Topic: e.topic, Partition: 0, Offset: 1, Reason: "permanent", Error: "bad", Age: time.Hour, Key: []byte("k"), Value: []byte("v")})[0]
	if _, err := db.Pool.Exec(ctx, `INSERT INTO kfn.audit_log (actor, action, consumer, topic, partition, details) VALUES ('grammar', 'park', $1, $2, 0, '{"offset": 1}')`, e.fn, e.topic); err != nil {
		t.Fatal(err)
	}
	// One event in the stream, for kfn tail --all.
	row := outbox.NewRow(outbox.Origin{Consumer: e.fn, Topic: e.topic, Offset: 1, SourceID: outbox.KafkaSourceID(e.topic, 0, 1)}, 0, "k", outbox.Event{Subject: e.subject, Data: []byte("1")})
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Insert(ctx, tx, []outbox.Row{row}) }); err != nil {
		t.Fatal(err)
	}
	relayCtx, stopRelay := context.WithCancel(context.Background())
	relayDone := make(chan struct{})
	go func() {
		defer close(relayDone)
		var out, errOut bytes.Buffer
		run(relayCtx, []string{"relay", "--database-url", e.db, "--nats-url", e.nats, "--subjects", e.subject, "--event-stream", e.stream, "--lease-bucket", e.bucket}, &out, &errOut)
	}()
	waitFor(t, "the relay to publish the event", func() bool {
		var n int
		return db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.outbox`).Scan(&n) == nil && n == 0
	})
	stopRelay()
	<-relayDone
	e.wrongPW = passwordCluster(t)
	e.consoleUsers = filepath.Join(t.TempDir(), "console-users")
	if err := os.WriteFile(e.consoleUsers, []byte("alice:viewer:sha256:"+strings.Repeat("ab", 32)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return e
}

// passwordCluster starts a throwaway cluster whose pg_hba.conf wants a
// scram password from alice (whose password is "right"), and returns a
// URL with a wrong one.
func passwordCluster(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "kfn-hba-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	hba := filepath.Join(dir, "pg_hba.conf")
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(hba, []byte("local all all trust\nhost all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	pg, err := devstack.StartPostgres(ctx, devstack.PostgresOptions{Settings: map[string]string{"hba_file": hba}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pg.Stop() })
	conn, err := pgx.Connect(ctx, pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `CREATE ROLE alice LOGIN PASSWORD 'right'`); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("postgres://alice:wrong@127.0.0.1:%d/postgres?sslmode=disable", pg.Port)
}

// documentedJSON reads docs/cli-json.md: per command (a "## kfn CMD"
// heading), the field paths of its table ("| `a.b[].c` | …").
func documentedJSON(t *testing.T) map[string]map[string]bool {
	t.Helper()
	f, err := os.Open("../../docs/cli-json.md")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	heading := regexp.MustCompile("^## `kfn ([a-z ]+) .*--json")
	field := regexp.MustCompile("^\\| `([a-z0-9_.*\\[\\]]+)`")
	out := map[string]map[string]bool{}
	var cmds []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if m := heading.FindStringSubmatch(sc.Text()); m != nil {
			name := strings.TrimSpace(m[1])
			cmds = []string{name}
			out[name] = map[string]bool{}
			continue
		}
		if m := field.FindStringSubmatch(sc.Text()); m != nil && len(cmds) > 0 {
			out[cmds[0]][m[1]] = true
		}
	}
	return out
}

// checkDocumentedJSON fails on a field of out (one JSON document, or one
// per line) that docs/cli-json.md does not list for cmd.
func checkDocumentedJSON(t *testing.T, cmd, out string, fields map[string]bool) {
	t.Helper()
	if cmd == "dlq" {
		fields = documentedJSON(t)["dlq list"]
	}
	if fields == nil {
		t.Errorf("docs/cli-json.md has no section for kfn %s --json", cmd)
		fields = map[string]bool{}
	}
	dec := json.NewDecoder(strings.NewReader(out))
	dec.UseNumber()
	n := 0
	for dec.More() {
		var v any
		if err := dec.Decode(&v); err != nil {
			t.Errorf("kfn %s --json: %v", cmd, err)
			return
		}
		n++
		for _, p := range jsonPaths("", v) {
			if os.Getenv("KFN_GRAMMAR_DUMP") != "" {
				fmt.Printf("JSONPATH %s\t%s\n", cmd, p)
			}
			if !documented(fields, p) {
				t.Errorf("kfn %s --json prints %s, which docs/cli-json.md does not document", cmd, p)
			}
		}
	}
	if n == 0 {
		t.Errorf("kfn %s --json printed nothing", cmd)
	}
}

// documented reports whether fields lists path p, or an ancestor of it
// as "a.*" or "a[].*" (an object whose keys vary: audit details).
func documented(fields map[string]bool, p string) bool {
	if fields[p] {
		return true
	}
	for i := len(p) - 1; i > 0; i-- {
		if p[i] == '.' && (fields[p[:i]+".*"] || (strings.HasSuffix(p[:i], "[]") && fields[p[:i]+".*"])) {
			return true
		}
	}
	return false
}

// jsonPaths lists the object keys in v as paths: a.b, a[].c ("[]" for the
// elements of an array; a top-level array's elements' keys have none).
func jsonPaths(prefix string, v any) []string {
	var out []string
	switch v := v.(type) {
	case map[string]any:
		for k, x := range v {
			p := k
			if prefix != "" {
				p = prefix + "." + k
			}
			out = append(out, p)
			out = append(out, jsonPaths(p, x)...)
		}
	case []any:
		for _, x := range v {
			p := prefix + "[]"
			if prefix == "" {
				p = ""
			}
			out = append(out, jsonPaths(p, x)...)
		}
	}
	sort.Strings(out)
	return slices.Compact(out)
}
