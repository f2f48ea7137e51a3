package main

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// The secrets the tests below give kfn; none may appear in any output.
const (
	pgPassword   = "pgPw7Hq2xZsecret"
	dsnPassword  = "dsnPw9Kd4Lsecret"
	natsPassword = "natsPw3Mv8Rsecret"
	natsToken    = "natsTok5Tq1Wsecret"
)

var allSecrets = []string{pgPassword, dsnPassword, natsPassword, natsToken}

// withPassword returns the test database's URL with a password added (the
// throwaway cluster trusts every connection, so it still connects).
func withPassword(t *testing.T, dbURL, password string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(u.User.Username(), password)
	return u.String()
}

// asDSN turns the test database's URL into a keyword/value string.
func asDSN(t *testing.T, dbURL, password string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("host=%s port=%s user=%s password='%s' dbname=%s sslmode=disable",
		u.Hostname(), u.Port(), u.User.Username(), password, strings.TrimPrefix(u.Path, "/"))
}

// noSecrets fails t for each secret found in out.
func noSecrets(t *testing.T, what, out string) {
	t.Helper()
	for _, s := range allSecrets {
		if strings.Contains(out, s) {
			t.Errorf("%s prints the secret %q:\n%s", what, s, out)
		}
	}
}

// TestSecretsAreNeverPrinted runs kfn's failing paths with passwords and
// tokens in its connection settings and looks for them in all the output.
func TestSecretsAreNeverPrinted(t *testing.T) {
	db := kfntest.Postgres(t)
	natsUser := "nats://alice:" + natsPassword + "@127.0.0.1:1"
	natsTok := "nats://" + natsToken + "@127.0.0.1:1"
	cases := []struct {
		name string
		args []string
		want string // in stderr
	}{
		{"unreachable Postgres, URL", []string{"migrate", "--database-url", "postgres://kfn:" + pgPassword + "@127.0.0.1:1/kfn?connect_timeout=2"}, "cannot reach Postgres at postgres://kfn:xxxxx@127.0.0.1:1/kfn"},
		{"unreachable Postgres, DSN", []string{"migrate", "--database-url", "host=127.0.0.1 port=1 user=kfn password=" + dsnPassword + " dbname=kfn connect_timeout=2"}, "cannot reach Postgres at host=127.0.0.1 port=1 user=kfn password=xxxxx"},
		{"URL that does not parse", []string{"migrate", "--database-url", "postgres://kfn:" + pgPassword + "@127.0.0.1:port/kfn"}, `"postgres://kfn:xxxxx@127.0.0.1:port/kfn" does not parse as a URL: invalid port ":port" after host`},
		{"DSN that pgx rejects", []string{"migrate", "--database-url", "host=127.0.0.1 port=notaport password=" + dsnPassword + " dbname=kfn"}, "--database-url (DATABASE_URL)"},
		{"status, unreachable NATS with user:pass", []string{"status", "--database-url", withPassword(t, db.URL, pgPassword), "--nats-url", natsUser}, "cannot reach NATS at nats://alice:xxxxx@127.0.0.1:1"},
		{"status, unreachable NATS with a token", []string{"status", "--database-url", withPassword(t, db.URL, pgPassword), "--nats-url", natsTok}, "cannot reach NATS at nats://xxxxx@127.0.0.1:1"},
		{"tail, unreachable NATS with a token", []string{"tail", "--nats-url", natsTok, "x.>"}, "cannot reach NATS"},
		{"verify, unreachable NATS with a token", []string{"verify", "--database-url", withPassword(t, db.URL, pgPassword), "--nats-url", natsTok, "--function", "f", "--topic", "t", "--kafka-brokers", "127.0.0.1:1"}, "cannot reach NATS"},
		{"replay, unreachable NATS with user:pass", []string{"replay", "--database-url", asDSN(t, db.URL, dsnPassword), "--nats-url", natsUser, "--function", "f", "--topic", "t", "--partition", "0", "--from-offset", "0", "--kafka-brokers", "127.0.0.1:1"}, ""},
	}
	for _, tc := range cases {
		code, stdout, stderr := kfn(t, tc.args...)
		if code == 0 || !strings.Contains(stderr, tc.want) {
			t.Errorf("%s: exit %d, stderr %q; want a failure saying %q", tc.name, code, stderr, tc.want)
		}
		noSecrets(t, tc.name, stdout+stderr)
		t.Logf("%s: %s", tc.name, strings.TrimSpace(stderr))
	}
}

// TestWorkerStartErrorsHideSecrets runs a function binary's main
// (worker.Main) against an unreachable Postgres and, with a reachable one
// whose URL holds a password, against an unreachable NATS.
func TestWorkerStartErrorsHideSecrets(t *testing.T) {
	db := kfntest.Postgres(t)
	k := kfntest.Kafka(t)
	fn := orders.Function()
	fn.Name, fn.Topic = kfntest.Name(t, "orders"), k.CreateTopic(t, 1)
	brokers := strings.Join(k.Brokers, ",")
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"unreachable Postgres, URL", []string{"--database-url", "postgres://kfn:" + pgPassword + "@127.0.0.1:1/kfn?connect_timeout=2", "--nats-url", "nats://127.0.0.1:1"}},
		{"unreachable Postgres, DSN", []string{"--database-url", "host=127.0.0.1 port=1 password=" + dsnPassword + " connect_timeout=2", "--nats-url", "nats://127.0.0.1:1"}},
		{"URL that does not parse", []string{"--database-url", "postgres://kfn:" + pgPassword + "@127.0.0.1:port/kfn", "--nats-url", natsTokURL()}},
		{"unreachable NATS, token", []string{"--database-url", withPassword(t, db.URL, pgPassword), "--nats-url", natsTokURL()}},
		{"unreachable NATS, user:pass", []string{"--database-url", asDSN(t, db.URL, dsnPassword), "--nats-url", "nats://alice:" + natsPassword + "@127.0.0.1:1"}},
	} {
		var stderr bytes.Buffer
		code := worker.Main(fn, append(tc.args, "--kafka-brokers", brokers, "--worker-id", "secrets-test"), &stderr)
		if code == 0 || stderr.Len() == 0 {
			t.Errorf("%s: exit %d, stderr %q; want a start-up error", tc.name, code, stderr.String())
		}
		noSecrets(t, tc.name, stderr.String())
		t.Logf("%s: %s", tc.name, strings.TrimSpace(stderr.String()))
	}
}

func natsTokURL() string { return "nats://" + natsToken + "@127.0.0.1:1" }

// TestDevBannerHidesAGivenPassword runs kfn dev against the test database
// given by a URL with a password: the banner shows it redacted, and the
// export line is left out, saying why.
func TestDevBannerHidesAGivenPassword(t *testing.T) {
	db := kfntest.Postgres(t)
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	code := run(ctx, []string{"dev", "--database-url", withPassword(t, db.URL, pgPassword), "--duration", "1s"}, &out, &errOut)
	if code != 0 {
		t.Fatalf("kfn dev: exit %d, stderr %s", code, errOut.String())
	}
	noSecrets(t, "kfn dev", out.String()+errOut.String())
	if !strings.Contains(out.String(), "postgres  postgres://postgres:xxxxx@") {
		t.Errorf("the banner does not show the given URL redacted:\n%s", out.String())
	}
	if !strings.Contains(out.String(), "# DATABASE_URL is not printed: it holds a password or a token") ||
		strings.Contains(out.String(), "export DATABASE_URL=") || !strings.Contains(out.String(), "export KFN_NATS_URL=") {
		t.Errorf("the export lines: want DATABASE_URL left out, saying so, and KFN_NATS_URL (no password) printed:\n%s", out.String())
	}
}

// TestKeywordValueDSNFromAFile migrates a database given as a keyword/value
// string in the file DATABASE_URL_FILE names.
func TestKeywordValueDSNFromAFile(t *testing.T) {
	db := kfntest.PostgresEmpty(t)
	file := filepath.Join(t.TempDir(), "database-url")
	if err := os.WriteFile(file, []byte(asDSN(t, db.URL, dsnPassword)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DATABASE_URL", "")
	t.Setenv("DATABASE_URL_FILE", file)
	code, out, stderr := kfn(t, "migrate")
	if code != 0 || !strings.Contains(out, "applied migrations") {
		t.Fatalf("kfn migrate with DATABASE_URL_FILE: exit %d, out %q, err %q", code, out, stderr)
	}
	noSecrets(t, "kfn migrate", out+stderr)

	// A file that cannot be read, and a value given both ways, are
	// configuration errors naming the variable.
	t.Setenv("DATABASE_URL_FILE", filepath.Join(t.TempDir(), "missing"))
	code, _, stderr = kfn(t, "migrate")
	if code != 2 || !strings.Contains(stderr, "(DATABASE_URL_FILE): cannot read the file it names") {
		t.Errorf("unreadable DATABASE_URL_FILE: exit %d, stderr %q", code, stderr)
	}
	t.Setenv("DATABASE_URL_FILE", file)
	t.Setenv("DATABASE_URL", db.URL)
	code, _, stderr = kfn(t, "migrate")
	if code != 2 || !strings.Contains(stderr, "both DATABASE_URL and DATABASE_URL_FILE are set") {
		t.Errorf("DATABASE_URL and DATABASE_URL_FILE: exit %d, stderr %q", code, stderr)
	}
	t.Setenv("DATABASE_URL", "")

	// KFN_NATS_URL_FILE: its token is used and never printed.
	natsFile := filepath.Join(t.TempDir(), "nats-url")
	if err := os.WriteFile(natsFile, []byte(natsTokURL()+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KFN_NATS_URL", "")
	t.Setenv("KFN_NATS_URL_FILE", natsFile)
	code, _, stderr = kfn(t, "tail", "x.>")
	if code == 0 || !strings.Contains(stderr, "cannot reach NATS at nats://xxxxx@127.0.0.1:1") {
		t.Errorf("kfn tail with KFN_NATS_URL_FILE: exit %d, stderr %q", code, stderr)
	}
	noSecrets(t, "kfn tail", stderr)
	t.Setenv("KFN_NATS_URL_FILE", filepath.Join(t.TempDir(), "missing"))
	code, _, stderr = kfn(t, "tail", "x.>")
	if code != 2 || !strings.Contains(stderr, "(KFN_NATS_URL_FILE): cannot read the file it names") {
		t.Errorf("unreadable KFN_NATS_URL_FILE: exit %d, stderr %q", code, stderr)
	}
}

// TestWorkerSessionsNameThemselves runs a worker on a keyword/value string
// and finds its sessions in pg_stat_activity as "kfn-worker <id>".
func TestWorkerSessionsNameThemselves(t *testing.T) {
	db := kfntest.Postgres(t)
	k := kfntest.Kafka(t)
	fn := orders.Function()
	fn.Name, fn.Topic = kfntest.Name(t, "orders"), k.CreateTopic(t, 1)
	ctx := context.Background()
	w, err := worker.New(ctx, runtime.Config{
		KafkaBrokers: k.Brokers, DatabaseURL: asDSN(t, db.URL, dsnPassword), NATSURL: kfntest.NATSURL(t), WorkerID: "appname-1",
	}, fn)
	if err != nil {
		t.Fatal(err)
	}
	kfntest.Background(t, "worker", w.Run)
	waitSession(t, db, "kfn-worker appname-1")

	// A command's sessions are "kfn <command>", unless the URL names them.
	for _, tc := range []struct{ url, want string }{
		{db.URL, "kfn status"},
		{db.URL + sep(db.URL) + "application_name=mine", "mine"},
	} {
		cctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			run(cctx, []string{"status", "--database-url", tc.url, "--watch", "200ms", "--json"}, &bytes.Buffer{}, &bytes.Buffer{})
		}()
		waitSession(t, db, tc.want)
		cancel()
		<-done
	}
}

func sep(u string) string {
	if strings.Contains(u, "?") {
		return "&"
	}
	return "?"
}

// waitSession waits for a session named name on the test's database.
func waitSession(t *testing.T, db *kfntest.PG, name string) {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = $2`, db.Database, name).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			var names []string
			rows, err := db.Pool.Query(ctx, `SELECT application_name FROM pg_stat_activity WHERE datname = $1`, db.Database)
			if err == nil {
				for rows.Next() {
					var s string
					_ = rows.Scan(&s)
					names = append(names, s)
				}
			}
			t.Fatalf("no session named %q in pg_stat_activity; there are %q", name, names)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
