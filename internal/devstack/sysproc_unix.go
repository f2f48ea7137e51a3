//go:build unix && !linux

package devstack

import "syscall"

// ChildAttr returns the process attributes for a server child process: it runs
// as cred (nil = the current user) in its own process group. Only Linux can tie
// the child's life to ours (Pdeathsig); elsewhere Stop must be called.
func ChildAttr(cred *syscall.Credential) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: cred, Setpgid: true}
}
