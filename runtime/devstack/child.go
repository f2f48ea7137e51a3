package devstack

import (
	"os/exec"
	"runtime"
)

// child is a server process started by startChild.
type child struct {
	cmd    *exec.Cmd
	exited chan struct{} // closed when the process has exited and been reaped
	err    error         // cmd.Wait's result; valid once exited is closed
}

// startChild starts cmd from a goroutine locked to its OS thread and keeps that
// thread alive until the child exits. On Linux the child is started with
// Pdeathsig, which fires when the *thread* that forked it exits; locking the
// thread stops the Go scheduler from retiring it early and killing the child.
func startChild(cmd *exec.Cmd) (*child, error) {
	c := &child{cmd: cmd, exited: make(chan struct{})}
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
