package kfntest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/devstack"
)

var builds struct {
	mu      sync.Mutex
	dir     string                  // removed by Main
	byBuild map[string]*buildResult // by package and flags
	dirOnce sync.Once
	dirErr  error
}

type buildResult struct {
	once sync.Once
	path string
	err  error
}

// BuildBinary builds the main package pkg (an import path in this module or
// its dependencies, such as github.com/kfn-dev/kfn/cmd/kfn) with `go build`
// once per test binary and returns the executable's path. Fault tests use it
// to run real worker processes. A race-enabled test binary builds with -race.
// flags go to `go build` as they are ("-tags=…", "-ldflags=-X …"); each set
// of flags is a binary of its own.
func BuildBinary(t testing.TB, pkg string, flags ...string) string {
	t.Helper()
	requireMain(t, "kfntest.BuildBinary (its output directory)")
	key := strings.Join(append([]string{pkg}, flags...), "\x00")
	builds.mu.Lock()
	if builds.byBuild == nil {
		builds.byBuild = map[string]*buildResult{}
	}
	r := builds.byBuild[key]
	if r == nil {
		r = &buildResult{}
		builds.byBuild[key] = r
	}
	builds.mu.Unlock()

	r.once.Do(func() { r.path, r.err = goBuild(pkg, flags) })
	if r.err != nil {
		t.Fatalf("kfntest: %v", r.err)
	}
	return r.path
}

func goBuild(pkg string, flags []string) (string, error) {
	builds.dirOnce.Do(func() {
		builds.dir, builds.dirErr = os.MkdirTemp("", "kfntest-bin-")
		if builds.dirErr == nil {
			dir := builds.dir
			onShutdown(func() { _ = os.RemoveAll(dir) })
		}
	})
	if builds.dirErr != nil {
		return "", fmt.Errorf("make build dir: %w", builds.dirErr)
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		if root := os.Getenv("GOROOT"); root != "" {
			goTool = filepath.Join(root, "bin", "go")
		} else {
			return "", fmt.Errorf("build %s: the go command is not on PATH: %w", pkg, err)
		}
	}
	out := filepath.Join(builds.dir, sanitizeName(strings.Join(append([]string{pkg}, flags...), "_")))
	args := []string{"build", "-o", out}
	if raceEnabled {
		args = append(args, "-race")
	}
	args = append(append(args, flags...), pkg)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	start := time.Now()
	cmd := exec.CommandContext(ctx, goTool, args...)
	output, err := devstack.RunChild(cmd)
	if err != nil {
		return "", fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, output)
	}
	logger.Debug("built binary", "pkg", pkg, "took", time.Since(start))
	return out, nil
}
