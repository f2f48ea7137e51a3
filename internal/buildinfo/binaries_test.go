package buildinfo_test

import (
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// repoRoot is the main module's directory (the checkout).
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// build builds kfn and the orders function from the checkout src into a
// temporary directory with the given go build flags.
func build(t *testing.T, src string, flags ...string) (kfn, orders string) {
	t.Helper()
	dir := t.TempDir()
	args := append([]string{"build", "-o", dir + string(os.PathSeparator)}, flags...)
	args = append(args, "./cmd/kfn", "./functions/orders/cmd/orders")
	cmd := exec.Command("go", args...)
	cmd.Dir = src
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return filepath.Join(dir, "kfn"), filepath.Join(dir, "orders")
}

// output runs a binary and returns its stdout; it must exit 0.
func output(t *testing.T, bin string, args ...string) string {
	t.Helper()
	out, err := exec.Command(bin, args...).Output()
	if err != nil {
		t.Fatalf("%s %s: %v", filepath.Base(bin), strings.Join(args, " "), err)
	}
	return string(out)
}

func TestBinariesStampedByTheLinkerPrintTheStampedVersion(t *testing.T) {
	const p = "github.com/kfn-dev/kfn/internal/buildinfo."
	ldflags := "-X " + p + "version=v9.8.7-rc.1 -X " + p + "commit=0123456789abcdef0123456789abcdef01234567 -X " + p + "date=2026-12-04T19:00:00Z"
	// -buildvcs=false, as CI and the images build: the stamp alone must carry it.
	kfn, orders := build(t, repoRoot(t), "-buildvcs=false", "-ldflags", ldflags)
	want := []string{"v9.8.7-rc.1\n", "commit   0123456789abcdef0123456789abcdef01234567\n", "built    2026-12-04T19:00:00Z\n"}
	for _, run := range []struct {
		bin  string
		args []string
	}{{kfn, []string{"version"}}, {kfn, []string{"--version"}}, {orders, []string{"--version"}}, {orders, []string{"migrate", "--version"}}} {
		out := output(t, run.bin, run.args...)
		if !strings.HasPrefix(out, filepath.Base(run.bin)+" ") {
			t.Errorf("%s %s does not start with its name:\n%s", filepath.Base(run.bin), strings.Join(run.args, " "), out)
		}
		for _, w := range want {
			if !strings.Contains(out, w) {
				t.Errorf("%s %s lacks %q:\n%s", filepath.Base(run.bin), strings.Join(run.args, " "), w, out)
			}
		}
	}
}

func TestABuildFromTheCheckoutReportsItsCommit(t *testing.T) {
	root := repoRoot(t)
	head, err := exec.Command("git", "-C", root, "rev-parse", "HEAD").Output()
	if err != nil {
		t.Fatalf("git rev-parse HEAD in %s (this test needs the git checkout): %v", root, err)
	}
	commit := strings.TrimSpace(string(head))
	src := root
	if fi, err := os.Stat(filepath.Join(root, ".git")); err == nil && !fi.IsDir() {
		src = cloneWithWorkingTree(t, root)
	}
	// -buildvcs=true on the command line overrides CI's GOFLAGS=-buildvcs=false.
	kfn, orders := build(t, src, "-buildvcs=true")
	for _, bin := range []string{kfn, orders} {
		out := output(t, bin, "--version")
		if !strings.Contains(out, "commit   "+commit) || !strings.Contains(out, "time     ") || strings.Contains(out, "(devel)") {
			t.Errorf("%s --version, built from commit %s without a stamp:\n%s", filepath.Base(bin), commit, out)
		}
	}
}

// cloneWithWorkingTree is for a git worktree, whose .git is a file: Go
// records VCS information only under a .git directory (cmd/go's vcs
// rules), so it clones root's HEAD (sharing its objects) and copies the
// working tree's files, uncommitted ones too, over the clone.
func cloneWithWorkingTree(t *testing.T, root string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "kfn")
	if out, err := exec.Command("git", "clone", "-q", "--shared", root, dir).CombinedOutput(); err != nil {
		t.Fatalf("git clone %s: %v\n%s", root, err, out)
	}
	files, err := exec.Command("git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard").Output()
	if err != nil {
		t.Fatalf("git ls-files: %v", err)
	}
	for _, f := range strings.Split(strings.TrimRight(string(files), "\x00"), "\x00") {
		data, err := os.ReadFile(filepath.Join(root, f))
		if errors.Is(err, fs.ErrNotExist) {
			os.Remove(filepath.Join(dir, f)) // deleted in the working tree
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, f)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}
