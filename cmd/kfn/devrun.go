package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/process"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
)

// This file is `kfn dev ./path/to/fn`: kfn dev builds the user's function
// packages, runs each as a child process against the dev stack, and
// rebuilds and restarts one whenever its module's sources change. A
// restart is a clean handoff: the old process is stopped with SIGTERM, so
// it finishes its batch and gives its leases back, before the new one
// starts, and nothing is applied twice.

// devChild is one function package kfn dev runs.
type devChild struct {
	pkgDir, modDir string
	name           string // from --describe
	desc           process.Description
	binDir         string
	env            []string
	logs           io.Writer

	mu      sync.Mutex
	cmd     *exec.Cmd
	exited  chan struct{}
	metrics string      // host:port of the running process's /metrics
	base    devCounters // the counters of the processes before the running one
	builds  int
}

// newDevChild finds pkg's module and builds it once.
func newDevChild(ctx context.Context, pkg, binDir string, logs io.Writer) (*devChild, error) {
	dir, err := filepath.Abs(pkg)
	if err != nil {
		return nil, err
	}
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return nil, &usageError{msg: fmt.Sprintf("%s is not a directory holding a Go main package", pkg)}
	}
	mod := dir
	for {
		if _, err := os.Stat(filepath.Join(mod, "go.mod")); err == nil {
			break
		}
		parent := filepath.Dir(mod)
		if parent == mod {
			return nil, &usageError{msg: fmt.Sprintf("%s is not inside a Go module (no go.mod above it)", pkg)}
		}
		mod = parent
	}
	c := &devChild{pkgDir: dir, modDir: mod, binDir: binDir, logs: logs}
	bin, err := c.build(ctx)
	if err != nil {
		return nil, err
	}
	out, err := exec.CommandContext(ctx, bin, "--describe").Output()
	if err != nil {
		return nil, fmt.Errorf("%s --describe: %w (is it a kfn function calling worker.Start?)", pkg, err)
	}
	if err := json.Unmarshal(out, &c.desc); err != nil || c.desc.Name == "" {
		return nil, fmt.Errorf("%s --describe printed %q: not a kfn function description", pkg, out)
	}
	c.name = c.desc.Name
	return c, nil
}

// build compiles the package into a new binary and returns its path.
func (c *devChild) build(ctx context.Context) (string, error) {
	c.builds++
	bin := filepath.Join(c.binDir, fmt.Sprintf("%s-%d", filepath.Base(c.pkgDir), c.builds))
	var out strings.Builder
	if err := goIn(ctx, c.pkgDir, &out, &out, "build", "-o", bin, "."); err != nil {
		return "", fmt.Errorf("build %s: %w\n%s", c.pkgDir, err, out.String())
	}
	return bin, nil
}

// prepare creates what the function consumes on the dev stack: its topic,
// or the stream capturing its subject.
func (c *devChild) prepare(ctx context.Context, st *stack, partitions int) error {
	if c.desc.Topic != "" {
		return ensureTopic(ctx, st.Brokers, st.Kafka, c.desc.Topic, partitions)
	}
	nc, js, err := connect.NATS(st.NATSURL, "kfn dev")
	if err != nil {
		return err
	}
	defer nc.Close()
	_, err = outbox.ExtendStream(ctx, js, c.desc.Stream, []string{c.desc.Subject},
		outbox.StreamLimits{Duplicates: outbox.DefaultDuplicates, MaxAge: outbox.DefaultStreamMaxAge})
	return err
}

// start runs bin with the stack's settings and a metrics address of its own.
// childEnviron is this process's environment without DATABASE_URL_FILE and
// KFN_NATS_URL_FILE: a child gets the stack's URLs as DATABASE_URL and
// KFN_NATS_URL, and a setting given both ways is an error.
func childEnviron() []string {
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if name == settings.DatabaseURL.FileEnv() || name == settings.NATSURL.FileEnv() {
			continue
		}
		env = append(env, kv)
	}
	return env
}

func (c *devChild) start(bin string) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	addr := ln.Addr().String()
	ln.Close()
	cmd := exec.Command(bin)
	cmd.Env = append(append(childEnviron(), c.env...),
		settings.MetricsAddr.Env+"="+addr, settings.WorkerID.Env+"=kfn-dev-"+c.name)
	cmd.Stdout, cmd.Stderr = c.logs, c.logs
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", c.name, err)
	}
	exited := make(chan struct{})
	go func() {
		cmd.Wait() //nolint:errcheck // its exit is reported by stop or by the progress line
		close(exited)
	}()
	c.mu.Lock()
	c.cmd, c.exited, c.metrics = cmd, exited, addr
	c.mu.Unlock()
	return nil
}

// stop ends the running process cleanly (SIGTERM), or kills it after 30 s.
func (c *devChild) stop() {
	c.mu.Lock()
	cmd, exited := c.cmd, c.exited
	c.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Signal(syscall.SIGTERM) //nolint:errcheck // it may have exited
	select {
	case <-exited:
	case <-time.After(30 * time.Second):
		cmd.Process.Kill() //nolint:errcheck
		<-exited
	}
}

// watch rebuilds and restarts the function when a source file of its
// module changes, until ctx ends. A build that fails keeps the running
// process.
func (c *devChild) watch(ctx context.Context, out io.Writer) {
	last := sourceFingerprint(c.modDir)
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := sourceFingerprint(c.modDir)
		if now == last {
			continue
		}
		last = now
		began := time.Now()
		bin, err := c.build(ctx)
		if err != nil {
			fmt.Fprintf(out, "kfn dev: %s: %v\nkfn dev: %s keeps running the previous build\n", c.name, err, c.name)
			continue
		}
		before := c.counters() // a batch committed while it stops is not counted here: the line may undercount by one batch
		c.stop()
		c.mu.Lock()
		c.base = c.base.plus(before)
		c.mu.Unlock()
		if err := c.start(bin); err != nil {
			fmt.Fprintf(out, "kfn dev: %s: %v\n", c.name, err)
			continue
		}
		fmt.Fprintf(out, "kfn dev: %s changed: rebuilt and restarted in %s\n", c.name, time.Since(began).Round(time.Millisecond))
	}
}

// sourceFingerprint sums up the Go sources of a module: their names, sizes
// and modification times. Hidden folders and testdata are left out.
func sourceFingerprint(dir string) string {
	var b strings.Builder
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error { //nolint:errcheck // best effort
		if err != nil {
			return nil
		}
		if d.IsDir() && path != dir && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		name := d.Name()
		if d.IsDir() || !(strings.HasSuffix(name, ".go") || name == "go.mod" || name == "go.sum") {
			return nil
		}
		if info, err := d.Info(); err == nil {
			fmt.Fprintf(&b, "%s %d %d\n", path, info.Size(), info.ModTime().UnixNano())
		}
		return nil
	})
	return b.String()
}

// devCounters are the counters kfn dev shows for a child, from its /metrics.
type devCounters struct {
	applied, duplicates, deadLettered, lag, relayed float64
	up                                              bool
}

// plus adds the counters of o (not the lag, a gauge).
func (k devCounters) plus(o devCounters) devCounters {
	k.applied += o.applied
	k.duplicates += o.duplicates
	k.deadLettered += o.deadLettered
	k.relayed += o.relayed
	return k
}

// total is the counters of every process so far: the running one's and
// those before it.
func (c *devChild) total() devCounters {
	k := c.counters()
	c.mu.Lock()
	defer c.mu.Unlock()
	base := c.base
	base.lag, base.up = k.lag, k.up
	return base.plus(k)
}

// counters reads the running process's counters.
func (c *devChild) counters() devCounters {
	c.mu.Lock()
	addr := c.metrics
	c.mu.Unlock()
	client := http.Client{Timeout: 500 * time.Millisecond}
	resp, err := client.Get("http://" + addr + "/metrics")
	if err != nil {
		return devCounters{}
	}
	defer resp.Body.Close()
	k := devCounters{up: true}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		name, rest, _ := strings.Cut(line, "{")
		if i := strings.LastIndexByte(rest, ' '); i < 0 {
			continue
		} else if v, err := strconv.ParseFloat(rest[i+1:], 64); err == nil {
			switch name {
			case "kfn_records_applied_total":
				k.applied += v
			case "kfn_records_duplicate_total":
				k.duplicates += v
			case "kfn_records_dead_lettered_total":
				k.deadLettered += v
			case "kfn_partition_lag":
				k.lag += v
			case "kfn_outbox_published_total":
				k.relayed += v
			}
		}
	}
	return k
}

// runDevFunctions is kfn dev with function packages: build, prepare, run,
// watch, and a progress line per function every second.
func runDevFunctions(ctx context.Context, pkgs []string, st *stack, partitions int, verbose bool, stdout, stderr io.Writer) error {
	binDir, err := os.MkdirTemp("", "kfn-dev-bin-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(binDir)
	logs := io.Discard
	if verbose {
		logs = stderr
	}
	var children []*devChild
	defer func() {
		for _, c := range children {
			c.stop()
		}
	}()
	env := []string{
		settings.DatabaseURL.Env + "=" + st.DatabaseURL,
		settings.NATSURL.Env + "=" + st.NATSURL,
		settings.KafkaBrokers.Env + "=" + strings.Join(st.Brokers, ","),
	}
	env = append(env, kafkaconn.Env(st.Kafka)...)
	for _, pkg := range pkgs {
		c, err := newDevChild(ctx, pkg, binDir, logs)
		if err != nil {
			return err
		}
		c.env = env
		if err := c.prepare(ctx, st, partitions); err != nil {
			return fmt.Errorf("%s: %w", c.name, err)
		}
		if err := c.start(filepath.Join(binDir, fmt.Sprintf("%s-%d", filepath.Base(c.pkgDir), c.builds))); err != nil {
			return err
		}
		children = append(children, c)
		source := c.desc.Topic
		if source == "" {
			source = c.desc.Subject
		}
		fmt.Fprintf(stdout, "kfn dev: running %s (%s), consuming %s; it is rebuilt and restarted when %s changes\n", c.name, pkg, source, c.modDir)
	}
	for _, c := range children {
		go c.watch(ctx, stdout)
	}
	start := time.Now()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil // Ctrl-C, or --duration ran out: the deferred stops end the functions cleanly
		case <-t.C:
		}
		for _, c := range children {
			k := c.total()
			state := "up"
			if !k.up {
				state = "starting (or down: kfn dev -v shows its logs)"
			}
			fmt.Fprintf(stdout, "[%5s] %s: applied %6.0f  duplicates skipped %4.0f  dead-lettered %4.0f  lag %5.0f  relayed %6.0f  %s\n",
				time.Since(start).Round(time.Second), c.name, k.applied, k.duplicates, k.deadLettered, k.lag, k.relayed, state)
		}
	}
}
