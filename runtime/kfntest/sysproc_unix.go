//go:build unix && !linux

package kfntest

import "syscall"

// childAttr puts a child process in its own process group. Only Linux can tie
// its life to ours; elsewhere the t.Cleanup that stops it must run.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
