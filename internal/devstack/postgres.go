package devstack

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// PostgresOptions configures StartPostgres. The zero value is a throwaway
// cluster in a new temporary directory on a free port.
type PostgresOptions struct {
	// Dir is the data directory. Empty means a new temporary directory that
	// Stop removes. A Dir that already holds a cluster (PG_VERSION) is reused
	// and kept by Stop; an empty or missing Dir is initialised with initdb.
	Dir string
	// Port to listen on at 127.0.0.1; 0 picks a free one.
	Port int
	// StartTimeout bounds initdb plus server start-up; default 60s.
	StartTimeout time.Duration
	// BinDir holds initdb and postgres; empty means PATH, then the newest
	// /usr/lib/postgresql/*/bin (or Homebrew's postgresql@N).
	BinDir string
	// Settings are extra server settings (name → value), passed as -c flags.
	// They override the defaults below.
	Settings map[string]string
	// Logger receives start/stop events; nil discards them.
	Logger *slog.Logger
	// TLSCert and TLSKey (PEM), both or neither, turn TLS on (ssl=on) with
	// this server certificate and its key; clients may still connect
	// without TLS (trust authentication for every host connection).
	TLSCert, TLSKey []byte
}

// defaultPostgresSettings are the server settings of every throwaway cluster.
// fsync and synchronous_commit keep their defaults on purpose: the fault tests
// rely on a committed transaction surviving a restart. wal_level=logical lets
// the WAL outbox (--outbox wal) decode its messages: every test database may
// have a slot of its own, hence the room for slots and walsenders.
var defaultPostgresSettings = map[string]string{
	"max_connections":       "300",
	"shared_buffers":        "128MB",
	"lc_messages":           "C",
	"wal_level":             "logical",
	"max_replication_slots": "100",
	"max_wal_senders":       "100",
}

// Postgres is a running throwaway PostgreSQL cluster.
type Postgres struct {
	// URL connects as the superuser `postgres` (trust auth) to database postgres:
	// postgres://postgres@127.0.0.1:PORT/postgres?sslmode=disable
	URL string
	// Port is the TCP port on 127.0.0.1; Restart keeps it.
	Port int
	// DataDir is the cluster's data directory.
	DataDir string
	// LogFile is the server's log, inside DataDir.
	LogFile string

	opts      PostgresOptions
	bin       pgBinaries
	user      serverUser
	socketDir string
	removeDir bool // DataDir was made by us and is removed by Stop
	rmSocket  bool // socketDir was made by us and is removed by Stop
	log       *slog.Logger

	mu   sync.Mutex
	proc *Child // nil while stopped
}

// StartPostgres creates (or reuses) a PostgreSQL cluster and starts it on
// 127.0.0.1 with trust authentication. As root it runs the server as the
// `postgres` user, since PostgreSQL refuses to run as root. The server is a
// child of this process: on Linux it dies with it.
func StartPostgres(ctx context.Context, opts PostgresOptions) (*Postgres, error) {
	if (opts.TLSCert == nil) != (opts.TLSKey == nil) {
		return nil, errors.New("start postgres: PostgresOptions: give both TLSCert and TLSKey, or neither")
	}
	if opts.StartTimeout <= 0 {
		opts.StartTimeout = 60 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, opts.StartTimeout)
	defer cancel()

	bin, err := findPostgresBinaries(opts.BinDir)
	if err != nil {
		return nil, fmt.Errorf("start postgres: %w", err)
	}
	u, err := lookupServerUser()
	if err != nil {
		return nil, fmt.Errorf("start postgres: %w", err)
	}
	p := &Postgres{opts: opts, bin: bin, user: u, log: opts.Logger}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	if err := p.prepare(ctx); err != nil {
		p.cleanupDirs()
		return nil, fmt.Errorf("start postgres: %w", err)
	}
	if err := p.startWithPortRetry(ctx); err != nil {
		p.cleanupDirs()
		return nil, fmt.Errorf("start postgres in %s: %w", p.DataDir, err)
	}
	return p, nil
}

// prepare makes the data directory, runs initdb when needed and picks the
// socket directory.
func (p *Postgres) prepare(ctx context.Context) error {
	p.DataDir = p.opts.Dir
	if p.DataDir == "" {
		dir, err := os.MkdirTemp("", "kfn-pg-")
		if err != nil {
			return fmt.Errorf("make temp data dir: %w", err)
		}
		p.DataDir, p.removeDir = dir, true
	}
	abs, err := filepath.Abs(p.DataDir)
	if err != nil {
		return fmt.Errorf("data dir %q: %w", p.DataDir, err)
	}
	p.DataDir = abs
	p.LogFile = filepath.Join(p.DataDir, "kfn-postgres.log")

	if _, err := os.Stat(filepath.Join(p.DataDir, "PG_VERSION")); err == nil {
		p.log.Info("reusing postgres cluster", "dir", p.DataDir)
	} else {
		if entries, err := os.ReadDir(p.DataDir); err == nil && len(entries) > 0 {
			return fmt.Errorf("data dir %s is not empty and holds no PostgreSQL cluster (no PG_VERSION): pass an empty or missing directory", p.DataDir)
		}
		if err := p.user.prepareDir(p.DataDir); err != nil {
			return err
		}
		if err := p.initdb(ctx); err != nil {
			return err
		}
	}

	if err := p.writeTLS(); err != nil {
		return err
	}

	// Unix socket paths must stay below ~100 bytes (sun_path); long data
	// directory paths get a short socket directory of their own.
	if len(p.DataDir)+len("/.s.PGSQL.65535.lock") < 100 {
		p.socketDir = p.DataDir
	} else {
		dir, err := os.MkdirTemp("/tmp", "kfnpg")
		if err != nil {
			return fmt.Errorf("make socket dir: %w", err)
		}
		p.socketDir, p.rmSocket = dir, true
		if err := p.user.prepareDir(dir); err != nil {
			return err
		}
	}
	return nil
}

// The server's certificate and key in the data directory (PostgresOptions.TLSCert).
const (
	tlsCertFile = "kfn-server.crt"
	tlsKeyFile  = "kfn-server.key"
)

// writeTLS writes the server's certificate and key, if given, into the data
// directory, readable by the server's user only (PostgreSQL refuses a key
// that others can read).
func (p *Postgres) writeTLS() error {
	if p.opts.TLSCert == nil {
		return nil
	}
	for name, data := range map[string][]byte{tlsCertFile: p.opts.TLSCert, tlsKeyFile: p.opts.TLSKey} {
		path := filepath.Join(p.DataDir, name)
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return fmt.Errorf("write %s: %w", path, err)
		}
		if p.user.cred != nil {
			if err := os.Chown(path, p.user.uid, p.user.gid); err != nil {
				return fmt.Errorf("hand %s to user %s: %w", path, p.user.name, err)
			}
		}
	}
	return nil
}

func (p *Postgres) initdb(ctx context.Context) error {
	start := time.Now()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, p.bin.initdb,
		"-D", p.DataDir, "-U", "postgres", "--auth=trust",
		"-E", "UTF8", "--locale=C", "--no-sync")
	cmd.Dir = p.DataDir
	cmd.Env = p.childEnv()
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = ChildAttr(p.user.cred)
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (timed out after %s)", err, p.opts.StartTimeout)
		}
		return fmt.Errorf("initdb %s: %w\n%s", p.DataDir, err, tail(out.Bytes(), 20))
	}
	p.log.Info("initialised postgres cluster", "dir", p.DataDir, "took", time.Since(start))
	return nil
}

// startWithPortRetry starts the server; when the port was picked by us and
// someone grabbed it in between, it tries another free port.
func (p *Postgres) startWithPortRetry(ctx context.Context) error {
	const attempts = 3
	for i := 0; ; i++ {
		p.Port = p.opts.Port
		if p.Port == 0 {
			port, err := FreePort()
			if err != nil {
				return err
			}
			p.Port = port
		}
		err := p.start(ctx)
		if err == nil || p.opts.Port != 0 || i == attempts-1 || !errors.Is(err, errPortInUse) {
			return err
		}
		p.log.Warn("postgres port was taken, trying another", "port", p.Port)
	}
}

var errPortInUse = errors.New("port already in use")

// start launches postgres on p.Port and waits until it accepts connections.
func (p *Postgres) start(ctx context.Context) error {
	started := time.Now()
	logf, err := os.OpenFile(p.LogFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("open server log: %w", err)
	}
	logOffset, _ := logf.Seek(0, io.SeekEnd)
	defer logf.Close() // the child holds its own descriptor

	args := []string{"-D", p.DataDir,
		"-c", "listen_addresses=127.0.0.1",
		"-c", "port=" + strconv.Itoa(p.Port),
		"-c", "unix_socket_directories=" + p.socketDir,
	}
	settings := map[string]string{}
	for k, v := range defaultPostgresSettings {
		settings[k] = v
	}
	if p.opts.TLSCert != nil {
		settings["ssl"] = "on"
		settings["ssl_cert_file"] = filepath.Join(p.DataDir, tlsCertFile)
		settings["ssl_key_file"] = filepath.Join(p.DataDir, tlsKeyFile)
	}
	for k, v := range p.opts.Settings {
		settings[k] = v
	}
	keys := make([]string, 0, len(settings))
	for k := range settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		args = append(args, "-c", k+"="+settings[k])
	}
	cmd := exec.Command(p.bin.postgres, args...)
	cmd.Dir = p.DataDir
	cmd.Env = p.childEnv()
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = ChildAttr(p.user.cred)
	proc, err := StartChild(cmd)
	if err != nil {
		return fmt.Errorf("run %s: %w", p.bin.postgres, err)
	}
	p.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", p.Port)

	if err := p.waitReady(ctx, proc); err != nil {
		_ = cmd.Process.Kill()
		<-proc.Exited()
		logTail := p.logSince(logOffset)
		if strings.Contains(logTail, "Address already in use") {
			err = fmt.Errorf("%w: %w", errPortInUse, err)
		}
		return fmt.Errorf("postgres on port %d did not come up: %w\nserver log %s (tail):\n%s", p.Port, err, p.LogFile, logTail)
	}
	p.mu.Lock()
	p.proc = proc
	p.mu.Unlock()
	p.log.Info("postgres started", "url", p.URL, "dir", p.DataDir, "took", time.Since(started))
	return nil
}

// waitReady waits until postmaster.pid, written by *our* postmaster, says
// "ready" and a connection succeeds. Checking the pid file first means a
// different server already listening on the port cannot fool us.
func (p *Postgres) waitReady(ctx context.Context, proc *Child) error {
	pid := proc.Cmd.Process.Pid
	pidFile := filepath.Join(p.DataDir, "postmaster.pid")
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-proc.Exited():
			return fmt.Errorf("server exited during start-up: %v", proc.Err())
		case <-ctx.Done():
			return fmt.Errorf("not ready after %s: %w", p.opts.StartTimeout, ctx.Err())
		case <-tick.C:
		}
		data, err := os.ReadFile(pidFile)
		if err != nil {
			continue
		}
		lines := strings.Split(string(data), "\n")
		if len(lines) < 8 || strings.TrimSpace(lines[0]) != strconv.Itoa(pid) || strings.TrimSpace(lines[7]) != "ready" {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		conn, err := pgconn.Connect(cctx, p.URL)
		cancel()
		if err != nil {
			continue
		}
		_ = conn.Close(context.Background())
		return nil
	}
}

// Stop shuts the server down like `pg_ctl stop -m fast` (SIGINT: roll back open
// transactions, checkpoint, exit) and removes the data directory if it was a
// temporary one. It is safe to call more than once.
func (p *Postgres) Stop() error {
	err := p.Shutdown()
	p.cleanupDirs()
	return err
}

// Restart stops the server (fast shutdown) and starts it again on the same
// port with the same data. Committed data survives; connections are dropped.
func (p *Postgres) Restart(ctx context.Context) error {
	if err := p.Shutdown(); err != nil {
		return fmt.Errorf("restart postgres: %w", err)
	}
	return p.Start(ctx)
}

// Start starts a server that Shutdown stopped, on the same port with the
// same data; a running server is left alone.
func (p *Postgres) Start(ctx context.Context) error {
	p.mu.Lock()
	running := p.proc != nil
	p.mu.Unlock()
	if running {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, p.opts.StartTimeout)
	defer cancel()
	if err := p.start(ctx); err != nil {
		return fmt.Errorf("start postgres in %s again: %w", p.DataDir, err)
	}
	return nil
}

// Shutdown stops the server process and keeps its data directory and its
// port, so that Start can start it again: SIGINT (fast: open transactions
// roll back, connections are dropped), then SIGQUIT (immediate), then
// SIGKILL, each with a bounded wait. A stopped server is left alone.
func (p *Postgres) Shutdown() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	proc := p.proc
	if proc == nil {
		return nil
	}
	p.proc = nil
	started := time.Now()
	steps := []struct {
		sig  os.Signal
		wait time.Duration
	}{
		{syscall.SIGINT, 30 * time.Second},
		{syscall.SIGQUIT, 5 * time.Second},
		{syscall.SIGKILL, 5 * time.Second},
	}
	for _, s := range steps {
		if err := proc.Cmd.Process.Signal(s.sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
			return fmt.Errorf("signal postgres (pid %d): %w", proc.Cmd.Process.Pid, err)
		}
		select {
		case <-proc.Exited():
			p.log.Info("postgres stopped", "dir", p.DataDir, "signal", s.sig, "took", time.Since(started))
			return nil
		case <-time.After(s.wait):
			p.log.Warn("postgres did not stop in time, escalating", "signal", s.sig, "waited", s.wait)
		}
	}
	return fmt.Errorf("postgres (pid %d) did not exit even after SIGKILL", proc.Cmd.Process.Pid)
}

func (p *Postgres) cleanupDirs() {
	if p.removeDir && p.DataDir != "" {
		if err := os.RemoveAll(p.DataDir); err != nil {
			p.log.Warn("remove postgres data dir", "dir", p.DataDir, "err", err)
		}
	}
	if p.rmSocket && p.socketDir != "" {
		_ = os.RemoveAll(p.socketDir)
	}
}

// childEnv is our environment without the libpq/server variables that could
// point initdb or postgres somewhere else.
func (p *Postgres) childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "PG") {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "LC_ALL=C")
}

// logSince returns the tail of what the server logged after offset.
func (p *Postgres) logSince(offset int64) string {
	f, err := os.Open(p.LogFile)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	data, _ := io.ReadAll(f)
	return tail(data, 30)
}

// tail returns the last n lines of b.
func tail(b []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
