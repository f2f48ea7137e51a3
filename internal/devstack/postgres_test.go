package devstack

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func TestPostgresStartQueryRestartStop(t *testing.T) {
	ctx := context.Background()
	start := time.Now()
	pg, err := StartPostgres(ctx, PostgresOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("throwaway cluster up in %s at %s", time.Since(start), pg.URL)
	t.Cleanup(func() { _ = pg.Stop() })

	want := "postgres://postgres@127.0.0.1:"
	if !strings.HasPrefix(pg.URL, want) || !strings.HasSuffix(pg.URL, "/postgres?sslmode=disable") {
		t.Fatalf("URL = %q, want %s<port>/postgres?sslmode=disable", pg.URL, want)
	}

	conn := connect(t, pg.URL)
	var maxConns string
	if err := conn.QueryRow(ctx, "SHOW max_connections").Scan(&maxConns); err != nil {
		t.Fatal(err)
	}
	if maxConns != "300" {
		t.Errorf("max_connections = %s, want 300", maxConns)
	}
	if _, err := conn.Exec(ctx, "CREATE TABLE kept (v int); INSERT INTO kept VALUES (42)"); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)

	port := pg.Port
	start = time.Now()
	if err := pg.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("restart took %s", time.Since(start))
	if pg.Port != port {
		t.Errorf("port changed on restart: %d -> %d", port, pg.Port)
	}
	conn = connect(t, pg.URL)
	var v int
	if err := conn.QueryRow(ctx, "SELECT v FROM kept").Scan(&v); err != nil {
		t.Fatalf("data lost across restart: %v", err)
	}
	if v != 42 {
		t.Errorf("v = %d after restart, want 42", v)
	}
	conn.Close(ctx)

	dir := pg.DataDir
	start = time.Now()
	if err := pg.Stop(); err != nil {
		t.Fatal(err)
	}
	t.Logf("stop took %s", time.Since(start))
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("temp data dir %s still exists after Stop (stat err %v)", dir, err)
	}
	if err := pg.Stop(); err != nil {
		t.Errorf("second Stop: %v", err)
	}
}

func TestPostgresReusesDirAndKeepsIt(t *testing.T) {
	ctx := context.Background()
	parent, err := os.MkdirTemp("", "kfn-devstack-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(parent) })
	// As root the server runs as user postgres, which must be able to reach
	// the data dir; MkdirTemp makes 0700 folders.
	if err := os.Chmod(parent, 0o755); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(parent, "data")

	pg, err := StartPostgres(ctx, PostgresOptions{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	conn := connect(t, pg.URL)
	if _, err := conn.Exec(ctx, "CREATE DATABASE reused"); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	if err := pg.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "PG_VERSION")); err != nil {
		t.Fatalf("Stop removed a caller-owned data dir: %v", err)
	}

	pg, err = StartPostgres(ctx, PostgresOptions{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pg.Stop() })
	conn = connect(t, pg.URL)
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_database WHERE datname = 'reused'").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Errorf("database created before the restart is gone")
	}
	conn.Close(ctx)
}

func TestPostgresRejectsUnreachableOrForeignDir(t *testing.T) {
	dir := t.TempDir() // 0700 parent owned by us
	if err := os.WriteFile(filepath.Join(dir, "junk"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := StartPostgres(context.Background(), PostgresOptions{Dir: dir})
	if err == nil || !strings.Contains(err.Error(), "not empty") {
		t.Fatalf("err = %v, want a 'not empty' error", err)
	}
	if os.Geteuid() == 0 {
		_, err := StartPostgres(context.Background(), PostgresOptions{Dir: filepath.Join(t.TempDir(), "data")})
		if err == nil || !strings.Contains(err.Error(), "cannot reach") {
			t.Fatalf("err = %v, want a 'cannot reach' error for a dir under a 0700 parent", err)
		}
	}
}

func TestPostgresBinariesMissing(t *testing.T) {
	_, err := StartPostgres(context.Background(), PostgresOptions{BinDir: t.TempDir()})
	if err == nil || !strings.Contains(err.Error(), "BinDir") {
		t.Fatalf("err = %v, want a BinDir error", err)
	}
	if !strings.Contains(ErrPostgresNotInstalled.Error(), "apt-get install postgresql") ||
		!strings.Contains(ErrPostgresNotInstalled.Error(), "brew install postgresql@16") {
		t.Errorf("install hint missing from %q", ErrPostgresNotInstalled)
	}
}

func TestPostgresTLSNeedsCertAndKey(t *testing.T) {
	for _, opts := range []PostgresOptions{{TLSCert: []byte("cert")}, {TLSKey: []byte("key")}} {
		if _, err := StartPostgres(context.Background(), opts); err == nil || !strings.Contains(err.Error(), "give both TLSCert and TLSKey") {
			t.Errorf("StartPostgres with only one of TLSCert and TLSKey: err = %v", err)
		}
	}
}

func connect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	return conn
}

func TestPostgresStartFailureShowsLog(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	port := l.Addr().(*net.TCPAddr).Port
	_, err = StartPostgres(context.Background(), PostgresOptions{Port: port})
	if err == nil {
		t.Fatal("started on a port that is taken")
	}
	if !strings.Contains(err.Error(), "Address already in use") {
		t.Fatalf("error does not carry the server log tail: %v", err)
	}
}
