// Package podmantest runs the podman CLI for kfn's container tests (the
// containers under faults, the Kubernetes example under podman kube play)
// with the settings hosts like CI's need: the runc runtime (crun fails on
// their cgroup setup) and deploy/containers.conf's cgroupfs unless
// CONTAINERS_CONF names another file. It builds function images with
// deploy/image.sh, as users do, and reads what the tests check of a
// container: its exit code, its log, its start and finish times, and when
// the worker in it received its stop signal. It is test support, not an
// API.
package podmantest

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Podman runs podman for one test.
type Podman struct {
	t testing.TB
	// Root is the repository's directory (deploy/ is under it).
	Root string
}

// New finds podman and points it at root/deploy/containers.conf unless
// CONTAINERS_CONF is set.
func New(t testing.TB, root string) *Podman {
	t.Helper()
	if _, err := exec.LookPath("podman"); err != nil {
		t.Fatalf("the container tests need podman (apt-get install podman runc): %v", err)
	}
	root, err := filepath.Abs(root)
	if err != nil {
		t.Fatal(err)
	}
	if os.Getenv("CONTAINERS_CONF") == "" {
		t.Setenv("CONTAINERS_CONF", filepath.Join(root, "deploy", "containers.conf"))
	}
	return &Podman{t: t, Root: root}
}

// Args puts podman's global flags before a command's arguments.
func (p *Podman) Args(a ...string) []string { return append([]string{"--runtime", "runc"}, a...) }

// Command is a podman command, not started.
func (p *Podman) Command(a ...string) *exec.Cmd { return exec.Command("podman", p.Args(a...)...) }

// Run runs podman and fails the test if it fails; it returns the output.
func (p *Podman) Run(a ...string) string {
	p.t.Helper()
	out, err := p.Command(a...).CombinedOutput()
	if err != nil {
		p.t.Fatalf("podman %s: %v\n%s", strings.Join(a, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// BuildImage builds the main package in dir pkg into image (tagged
// image:VERSION and image:dev) with deploy/image.sh; env adds to its
// environment (VERSION=…).
func (p *Podman) BuildImage(pkg, image string, env ...string) {
	p.t.Helper()
	start := time.Now()
	cmd := exec.Command("bash", filepath.Join(p.Root, "deploy", "image.sh"), pkg, image)
	cmd.Dir = p.Root
	cmd.Env = append(os.Environ(), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		p.t.Fatalf("deploy/image.sh %s %s: %v\n%s", pkg, image, err, out)
	}
	p.t.Logf("built image %s in %s", image, time.Since(start).Round(time.Millisecond))
}

// Inspect returns a container's field (a Go template of podman inspect).
func (p *Podman) Inspect(name, format string) string {
	p.t.Helper()
	return p.Run("inspect", "--format", format, name)
}

// ExitCode is a stopped container's exit code.
func (p *Podman) ExitCode(name string) int {
	p.t.Helper()
	code, err := strconv.Atoi(p.Inspect(name, "{{.State.ExitCode}}"))
	if err != nil {
		p.t.Fatalf("podman inspect %s: exit code: %v", name, err)
	}
	return code
}

// Time reads a time of a container's State: StartedAt or FinishedAt.
func (p *Podman) Time(name, field string) time.Time {
	p.t.Helper()
	ns, err := strconv.ParseInt(p.Inspect(name, "{{.State."+field+".UnixNano}}"), 10, 64)
	if err != nil {
		p.t.Fatalf("podman inspect %s: %s: %v", name, field, err)
	}
	return time.Unix(0, ns)
}

// Logs returns the last n lines a container wrote (all of them for n 0).
func (p *Podman) Logs(name string, n int) string {
	args := []string{"logs"}
	if n > 0 {
		args = append(args, "--tail", strconv.Itoa(n))
	}
	out, err := p.Command(append(args, name)...).CombinedOutput()
	if err != nil {
		return fmt.Sprintf("(podman logs %s: %v: %s)", name, err, out)
	}
	return string(out)
}

// SignalledAt reads when the kfn worker in container name received its
// stop signal: the time of its "stopping:" log line, whose cause must be
// SIGTERM.
func (p *Podman) SignalledAt(name string) time.Time {
	p.t.Helper()
	for line := range strings.Lines(p.Logs(name, 0)) {
		var e struct {
			Time  time.Time `json:"time"`
			Msg   string    `json:"msg"`
			Cause string    `json:"cause"`
		}
		if json.Unmarshal([]byte(line), &e) == nil && strings.HasPrefix(e.Msg, "stopping:") {
			if e.Cause != "terminated signal received" {
				p.t.Errorf("%s stopped for %q, want SIGTERM", name, e.Cause)
			}
			return e.Time
		}
	}
	p.t.Fatalf("container %s logged no \"stopping:\" line:\n%s", name, p.Logs(name, 30))
	return time.Time{}
}
