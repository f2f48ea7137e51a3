package kfntest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/devstack"
)

// Process is a child process of the test (a worker, a server) that fault
// tests kill, pause and resume. On Linux it dies with the test binary, and it
// is always stopped when the test ends.
type Process struct {
	// Cmd is the started command; read Cmd.Process.Pid for the pid.
	Cmd *exec.Cmd
	// LogFile receives the process's stdout and stderr unless the Cmd given
	// to StartProcess had its own.
	LogFile string

	t     testing.TB
	child *devstack.Child
	once  sync.Once
}

// StartProcess starts cmd and registers a t.Cleanup that stops it; when the
// test has failed, the cleanup also logs the tail of the process's output.
func StartProcess(t testing.TB, cmd *exec.Cmd) *Process {
	t.Helper()
	p, err := startProcess(t, cmd)
	if err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	return p
}

func startProcess(t testing.TB, cmd *exec.Cmd) (*Process, error) {
	p := &Process{Cmd: cmd, t: t}
	if cmd.Stdout == nil && cmd.Stderr == nil {
		dir := t.TempDir()
		if keep := os.Getenv("KFN_TEST_PROCESS_LOGS"); keep != "" {
			dir = keep
		}
		f, err := os.CreateTemp(dir, filepath.Base(cmd.Path)+"-*.log")
		if err != nil {
			return nil, fmt.Errorf("create process log: %w", err)
		}
		defer f.Close() // the child keeps its own descriptor
		p.LogFile = f.Name()
		cmd.Stdout, cmd.Stderr = f, f
	}
	child, err := devstack.StartChild(cmd)
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", strings.Join(cmd.Args, " "), err)
	}
	p.child = child
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() && p.LogFile != "" {
			t.Logf("kfntest: last output of %s (pid %d):\n%s", filepath.Base(cmd.Path), cmd.Process.Pid, p.LogTail(50))
		}
	})
	return p, nil
}

// Exited is closed once the process has exited.
func (p *Process) Exited() <-chan struct{} { return p.child.Exited() }

// ExitErr is the process's exit status (cmd.Wait's error); call it after
// Exited is closed.
func (p *Process) ExitErr() error { return p.child.Err() }

// Stop sends SIGTERM and waits up to 10 s for the process to exit, then
// SIGKILLs it. A paused process is resumed first so it can see the SIGTERM.
func (p *Process) Stop() {
	p.stop(syscall.SIGTERM, 10*time.Second)
}

// Kill sends SIGKILL and waits for the process to exit.
func (p *Process) Kill() {
	p.stop(syscall.SIGKILL, 10*time.Second)
}

// Pause freezes the process with SIGSTOP, leaving its connections open: a
// zombie that wakes up later with Resume.
func (p *Process) Pause() { p.signal(syscall.SIGSTOP) }

// Resume continues a paused process with SIGCONT.
func (p *Process) Resume() { p.signal(syscall.SIGCONT) }

func (p *Process) signal(sig syscall.Signal) {
	if err := p.Cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		p.t.Errorf("kfntest: signal %v to pid %d: %v", sig, p.Cmd.Process.Pid, err)
	}
}

func (p *Process) stop(sig syscall.Signal, wait time.Duration) {
	select {
	case <-p.Exited():
		return
	default:
	}
	p.signal(sig)
	if sig != syscall.SIGKILL {
		p.signal(syscall.SIGCONT)
	}
	select {
	case <-p.Exited():
		return
	case <-time.After(wait):
	}
	p.once.Do(func() {
		p.t.Logf("kfntest: pid %d ignored %v for %s; sending SIGKILL", p.Cmd.Process.Pid, sig, wait)
	})
	p.signal(syscall.SIGKILL)
	select {
	case <-p.Exited():
	case <-time.After(wait):
		p.t.Errorf("kfntest: pid %d did not exit after SIGKILL", p.Cmd.Process.Pid)
	}
}

// LogTail returns the last n lines the process wrote to LogFile.
func (p *Process) LogTail(n int) string {
	if p.LogFile == "" {
		return ""
	}
	data, err := os.ReadFile(p.LogFile)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", p.LogFile, err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
