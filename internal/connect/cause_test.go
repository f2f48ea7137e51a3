package connect_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/devstack"
	"github.com/kfn-dev/kfn/runtime"
)

// passwordPostgres starts a throwaway cluster whose pg_hba.conf wants a
// password from every user but postgres, and TLS (which it does not
// serve) from user needtls; alice's password is "right".
func passwordPostgres(t *testing.T) (port int) {
	t.Helper()
	dir, err := os.MkdirTemp("", "kfn-hba-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	hba := filepath.Join(dir, "pg_hba.conf")
	conf := "local all all trust\nhost all postgres 127.0.0.1/32 trust\nhostssl all needtls 127.0.0.1/32 trust\nhostnossl all needtls 127.0.0.1/32 reject\nhost all all 127.0.0.1/32 scram-sha-256\n"
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(hba, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	pg, err := devstack.StartPostgres(ctx, devstack.PostgresOptions{Settings: map[string]string{"hba_file": hba}})
	if err != nil {
		t.Skipf("no PostgreSQL here: %v", err)
	}
	t.Cleanup(func() { _ = pg.Stop() })
	admin, err := pgx.Connect(ctx, pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, `CREATE ROLE alice LOGIN PASSWORD 'right'; CREATE ROLE needtls LOGIN`); err != nil {
		t.Fatal(err)
	}
	return pg.Port
}

// Each way a first Postgres connection fails is its own cause and its own
// message, from real errors: a wrong password, a closed port, a server
// that does not offer the TLS the client requires, a pg_hba.conf that
// wants TLS, an address that does not answer.
func TestPostgresCausesFromRealErrors(t *testing.T) {
	port := passwordPostgres(t)
	for _, tc := range []struct {
		name, url string
		cause     connect.Cause
		want      string
	}{
		{"wrong password", fmt.Sprintf("postgres://alice:wrong@127.0.0.1:%d/postgres?sslmode=disable", port), connect.CauseAuth,
			fmt.Sprintf(`Postgres at 127.0.0.1:%d refused user "alice": wrong password`, port)},
		{"no such user", fmt.Sprintf("postgres://mallory:x@127.0.0.1:%d/postgres?sslmode=disable", port), connect.CauseAuth,
			fmt.Sprintf(`Postgres at 127.0.0.1:%d refused user "mallory"`, port)},
		{"closed port", "postgres://alice:right@127.0.0.1:1/postgres?sslmode=disable", connect.CauseRefused,
			"cannot reach Postgres at postgres://alice:xxxxx@127.0.0.1:1/postgres?sslmode=disable: connection refused, nothing listens there"},
		{"TLS required by the client", fmt.Sprintf("postgres://alice:right@127.0.0.1:%d/postgres?sslmode=require", port), connect.CauseTLS,
			"does not offer TLS: lower sslmode"},
		{"TLS required by pg_hba.conf", fmt.Sprintf("postgres://needtls@127.0.0.1:%d/postgres?sslmode=disable", port), connect.CauseTLS,
			"TLS with Postgres at"},
		{"no answer", fmt.Sprintf("postgres://alice:right@%s/postgres?sslmode=disable&connect_timeout=1", silentListener(t)), connect.CauseUnreachable,
			"cannot reach Postgres at postgres://alice:xxxxx@127.0.0.1:"},
		{"unknown host", "postgres://alice:right@nosuch.invalid:5432/postgres?sslmode=disable&connect_timeout=2", connect.CauseUnreachable,
			"cannot reach Postgres at postgres://alice:xxxxx@nosuch.invalid:5432/postgres?sslmode=disable&connect_timeout=2: no answer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			pool, err := connect.Postgres(ctx, tc.url, "cause-test", nil)
			if err == nil {
				pool.Close()
				t.Fatal("connected")
			}
			if got := connect.PostgresCause(err); got != tc.cause {
				t.Errorf("cause %v, want %v: %v", got, tc.cause, err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("message %q lacks %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "right") || strings.Contains(err.Error(), ":wrong@") {
				t.Errorf("message %q shows the password", err)
			}
		})
	}
}

// silentListener is an address that accepts TCP connections and never
// says a word: a frozen server, to a client no different from no answer.
func silentListener(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l.Addr().String()
}

func startNATS(t *testing.T, opts *server.Options) string {
	t.Helper()
	opts.Host, opts.Port, opts.NoLog, opts.NoSigs = "127.0.0.1", -1, true, true
	s, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server not ready")
	}
	t.Cleanup(s.Shutdown)
	return s.ClientURL()
}

// The same for NATS: a real server that wants a token or a user, a closed
// port, a client that wants TLS from a server without it, an address that
// does not answer.
func TestNATSCausesFromRealErrors(t *testing.T) {
	withToken := startNATS(t, &server.Options{Authorization: "s3cret-token"})
	withUser := startNATS(t, &server.Options{Username: "bob", Password: "right"})
	for _, tc := range []struct {
		name, url string
		sec       runtime.NATSSecurity
		cause     connect.Cause
		want      string
	}{
		{"wrong token", strings.Replace(withToken, "nats://", "nats://wrong-token@", 1), runtime.NATSSecurity{}, connect.CauseAuth, "refused the token of --nats-url"},
		{"no token", withToken, runtime.NATSSecurity{}, connect.CauseAuth, "wants credentials"},
		{"wrong password", strings.Replace(withUser, "nats://", "nats://bob:wrong@", 1), runtime.NATSSecurity{}, connect.CauseAuth, `refused user "bob" (or its password)`},
		{"closed port", "nats://127.0.0.1:1", runtime.NATSSecurity{}, connect.CauseRefused, "cannot reach NATS at nats://127.0.0.1:1: connection refused, nothing listens there"},
		{"unknown host", "nats://nosuch.invalid:4222", runtime.NATSSecurity{}, connect.CauseUnreachable, "cannot reach NATS at nats://nosuch.invalid:4222: no answer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nc, _, err := connect.NATSWith(tc.url, "cause-test", tc.sec)
			if err == nil {
				nc.Close()
				t.Fatal("connected")
			}
			if got := connect.NATSCause(err); got != tc.cause {
				t.Errorf("cause %v, want %v: %v", got, tc.cause, err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("message %q lacks %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "wrong-token") || strings.Contains(err.Error(), "s3cret") {
				t.Errorf("message %q shows the token", err)
			}
		})
	}
}
