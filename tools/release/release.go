package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// stamp is the package whose variables the linker sets (-X): what
// --version prints.
const stamp = "github.com/kfn-dev/kfn/internal/buildinfo"

var (
	// imageTag is what an image tag may be: the version becomes one.
	imageTag = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)
	// releaseTag is a release's version: a semantic version tag.
	releaseTag = regexp.MustCompile(`^v[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$`)
	platform   = regexp.MustCompile(`^[a-z0-9]+/[a-z0-9]+$`)
)

// functions are the images a release builds: name → main package.
var functions = []struct{ name, pkg string }{
	{"kfn", "./cmd/kfn"}, // the relay and the migrate jobs
	{"kfn-orders", "./functions/orders/cmd/orders"},
	{"kfn-ledger", "./functions/ledger/cmd/ledger"},
}

// release is one run: what it stamps and where it writes.
type release struct {
	options
	version, commit, built string
	log                    io.Writer
}

func newRelease(ctx context.Context, o options, log io.Writer) (*release, error) {
	root, err := filepath.Abs(o.root)
	if err != nil {
		return nil, err
	}
	o.root = root
	if !filepath.IsAbs(o.out) {
		o.out = filepath.Join(root, o.out)
	}
	if len(o.platforms) == 0 {
		return nil, fmt.Errorf("--platforms is empty: name at least one GOOS/GOARCH, e.g. linux/amd64")
	}
	for _, p := range o.platforms {
		if !platform.MatchString(p) {
			return nil, fmt.Errorf("--platforms: %q is not GOOS/GOARCH, e.g. linux/amd64", p)
		}
	}
	r := &release{options: o, log: log}
	if r.commit, err = r.git(ctx, "rev-parse", "HEAD"); err != nil {
		return nil, fmt.Errorf("the commit of %s (a release is built from a git checkout): %w", root, err)
	}
	r.version = os.Getenv("VERSION")
	if r.version == "" {
		if r.version, err = r.git(ctx, "describe", "--tags", "--always", "--dirty"); err != nil {
			return nil, fmt.Errorf("git describe (or set VERSION): %w", err)
		}
	}
	if !imageTag.MatchString(r.version) {
		return nil, fmt.Errorf("version %q cannot be an image tag: set VERSION to letters, digits, '.', '_' and '-'", r.version)
	}
	if !o.snapshot {
		if err := r.checkReleasable(ctx); err != nil {
			return nil, err
		}
	}
	r.built = time.Now().UTC().Format(time.RFC3339)
	if epoch := os.Getenv("SOURCE_DATE_EPOCH"); epoch != "" { // reproducible builds' convention
		sec, err := strconv.ParseInt(epoch, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("SOURCE_DATE_EPOCH %q is not a Unix time in seconds", epoch)
		}
		r.built = time.Unix(sec, 0).UTC().Format(time.RFC3339)
	}
	return r, nil
}

// checkReleasable refuses a release (not a snapshot) of anything but a
// clean checkout whose HEAD is the version's tag.
func (r *release) checkReleasable(ctx context.Context) error {
	if !releaseTag.MatchString(r.version) {
		return fmt.Errorf("version %q is not a release tag (vX.Y.Z): tag HEAD (git tag v0.1.0), or build a snapshot with --snapshot", r.version)
	}
	tagged, err := r.git(ctx, "rev-parse", r.version+"^{commit}")
	if err != nil || tagged != r.commit {
		return fmt.Errorf("tag %s is not HEAD (%s): check out the tag, or build a snapshot with --snapshot", r.version, r.commit)
	}
	if status, err := r.git(ctx, "status", "--porcelain", "--untracked-files=no"); err != nil || status != "" {
		return fmt.Errorf("the checkout has uncommitted changes: commit or stash them, or build a snapshot with --snapshot")
	}
	return nil
}

// build makes every artifact, then checksums.txt.
func (r *release) build(ctx context.Context) error {
	if r.images {
		if _, err := exec.LookPath("podman"); err != nil {
			return fmt.Errorf("podman is not installed, and the function images need it: install it (Debian: apt-get install podman runc), or skip the images with --no-images")
		}
	}
	if rel, err := filepath.Rel(r.out, r.root); err != nil || !strings.HasPrefix(rel, "..") {
		return fmt.Errorf("--out %s holds the checkout: name a folder of its own, e.g. dist (it is emptied first)", r.out)
	}
	if err := os.RemoveAll(r.out); err != nil {
		return err
	}
	if err := os.MkdirAll(r.out, 0o755); err != nil {
		return err
	}
	fmt.Fprintf(r.log, "release %s (commit %s, built %s) into %s\n", r.version, r.commit, r.built, r.out)
	for _, p := range r.platforms {
		goos, goarch, _ := strings.Cut(p, "/")
		bin := filepath.Join(r.out, fmt.Sprintf("kfn_%s_%s_%s", r.version, goos, goarch))
		if goos == "windows" {
			bin += ".exe"
		}
		if err := r.buildCLI(ctx, goos, goarch, bin); err != nil {
			return err
		}
		if err := r.sbom(ctx, bin, bin+".cdx.json"); err != nil {
			return err
		}
	}
	if r.images {
		for _, f := range functions {
			if err := r.image(ctx, f.name, f.pkg); err != nil {
				return err
			}
		}
	}
	if err := r.manifests(); err != nil {
		return err
	}
	return writeChecksums(r.out)
}

// ldflags strip the symbols and stamp the version, commit and build time.
func (r *release) ldflags() string {
	return fmt.Sprintf("-s -w -X %s.version=%s -X %s.commit=%s -X %s.date=%s", stamp, r.version, stamp, r.commit, stamp, r.built)
}

// buildCLI cross-builds kfn, static and from the main module alone
// (GOWORK=off: a user's build has no go.work), as the images do.
func (r *release) buildCLI(ctx context.Context, goos, goarch, bin string) error {
	fmt.Fprintf(r.log, "build %s\n", filepath.Base(bin))
	return r.cmd(ctx, []string{"CGO_ENABLED=0", "GOOS=" + goos, "GOARCH=" + goarch, "GOWORK=off"},
		"go", "build", "-trimpath", "-buildvcs=false", "-ldflags", r.ldflags(), "-o", bin, "./cmd/kfn")
}

// sbom writes bin's CycloneDX SBOM (JSON) with cyclonedx-gomod, a tool of
// the tools module: the modules linked into the binary, read from its
// build information.
func (r *release) sbom(ctx context.Context, bin, out string) error {
	cmd := exec.CommandContext(ctx, "go", "tool", "cyclonedx-gomod", "bin", "-json", "-version", r.version, "-output", out, bin)
	cmd.Dir = filepath.Join(r.root, "tools") // the tools module alone, whatever GOWORK says
	cmd.Env = append(os.Environ(), "GOWORK=off")
	cmd.Stdout, cmd.Stderr = r.log, r.log
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("SBOM of %s (go tool cyclonedx-gomod bin): %w", filepath.Base(bin), err)
	}
	return nil
}

// git runs git in the checkout and returns its trimmed output.
func (r *release) git(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "git", append([]string{"-C", r.root}, args...)...)
	var errOut bytes.Buffer
	cmd.Stderr = &errOut
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errOut.String()))
	}
	return strings.TrimSpace(string(out)), nil
}

// cmd runs a command in the checkout with extra environment, its output
// going to the log; a failure carries the command.
func (r *release) cmd(ctx context.Context, env []string, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = r.root
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = r.log, r.log
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %s: %w", name, strings.Join(args, " "), err)
	}
	return nil
}
