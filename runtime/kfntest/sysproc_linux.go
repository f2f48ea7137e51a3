package kfntest

import "syscall"

// childAttr makes a child process die with the thread that started it
// (Pdeathsig), so a test binary killed by `go test -timeout` leaves no worker
// or server behind, and puts it in its own process group.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
}
