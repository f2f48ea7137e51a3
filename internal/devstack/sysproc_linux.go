package devstack

import "syscall"

// ChildAttr returns the process attributes for a server child process: it runs
// as cred (nil = the current user) and gets SIGKILL when the thread that started
// it goes away, so a test binary killed by `go test -timeout` or a `kfn dev`
// killed with SIGKILL does not leave a server running.
func ChildAttr(cred *syscall.Credential) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGKILL, Setpgid: true}
}
