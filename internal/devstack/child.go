package devstack

import (
	"os/exec"
	"runtime"
)

// Child is a process (a server, a worker) tied to this one: on Linux it gets
// SIGKILL when the thread that started it goes away, so a test binary killed
// by `go test -timeout`, or a `kfn dev` killed with SIGKILL, leaves nothing
// running.
type Child struct {
	Cmd    *exec.Cmd
	exited chan struct{} // closed when the process has exited and been reaped
	err    error         // cmd.Wait's result; valid once exited is closed
}

// StartChild starts cmd from a goroutine locked to its OS thread and keeps
// that thread alive until the child exits. Pdeathsig fires when the *thread*
// that forked the child exits; locking the thread stops the Go scheduler from
// retiring it early and killing the child. cmd.SysProcAttr defaults to
// ChildAttr(nil).
func StartChild(cmd *exec.Cmd) (*Child, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = ChildAttr(nil)
	}
	c := &Child{Cmd: cmd, exited: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		c.err = cmd.Wait()
		close(c.exited)
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return c, nil
}

// Exited is closed once the process has exited.
func (c *Child) Exited() <-chan struct{} { return c.exited }

// Err is the process's exit status (cmd.Wait's error); read it after Exited
// is closed.
func (c *Child) Err() error { return c.err }

// RunChild runs cmd to completion as a child (see StartChild) and returns its
// combined output.
func RunChild(cmd *exec.Cmd) ([]byte, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = ChildAttr(nil)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return cmd.CombinedOutput()
}
