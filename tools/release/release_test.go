package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

const root = "../.."

func head(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("git", "-C", root, "rev-parse", "HEAD").Output()
	if err != nil {
		t.Fatalf("git rev-parse HEAD (the release is built from the git checkout): %v", err)
	}
	return strings.TrimSpace(string(out))
}

// TestSnapshotReleaseForLinuxAMD64 runs the release's fast path (one
// platform, no images) and checks what a user verifies: the binary prints
// the stamped version, checksums.txt matches every file, each binary has
// a CycloneDX SBOM naming kfn's module, the manifests carry the version.
func TestSnapshotReleaseForLinuxAMD64(t *testing.T) {
	const version = "v0.0.0-releasetest"
	t.Setenv("VERSION", version)
	out := t.TempDir()
	var stdout, log bytes.Buffer
	if err := run(context.Background(), []string{"--root", root, "--out", out, "--snapshot", "--platforms", "linux/amd64", "--no-images"}, &stdout, &log); err != nil {
		t.Fatalf("release: %v\n%s", err, log.String())
	}
	t.Logf("%s", stdout.String())
	bin := filepath.Join(out, "kfn_"+version+"_linux_amd64")
	files := map[string]bool{}
	entries, err := os.ReadDir(out)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		files[e.Name()] = true
		if !strings.Contains(stdout.String(), e.Name()) {
			t.Errorf("the listing does not name %s:\n%s", e.Name(), stdout.String())
		}
	}
	for _, want := range []string{filepath.Base(bin), filepath.Base(bin) + ".cdx.json", "kfn-kubernetes_" + version + ".yaml", "checksums.txt"} {
		if !files[want] {
			t.Errorf("the release has no %s (it has %v)", want, files)
		}
	}

	// The binary prints the stamped version, the commit and the build time.
	v, err := exec.Command(bin, "--version").Output()
	if err != nil {
		t.Fatalf("%s --version: %v", bin, err)
	}
	for _, want := range []string{"kfn " + version + "\n", "commit   " + head(t) + "\n"} {
		if !strings.Contains(string(v), want) {
			t.Errorf("kfn --version lacks %q:\n%s", want, v)
		}
	}
	if !regexp.MustCompile(`(?m)^built    \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$`).Match(v) {
		t.Errorf("kfn --version has no build time:\n%s", v)
	}

	// checksums.txt lists every other file with its SHA-256.
	sums, err := os.ReadFile(filepath.Join(out, "checksums.txt"))
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(sums))
	for sc.Scan() {
		sum, name, ok := strings.Cut(sc.Text(), "  ")
		if !ok {
			t.Fatalf("checksums.txt line %q is not sha256sum's format", sc.Text())
		}
		listed[name] = true
		got, err := sha256File(filepath.Join(out, name))
		if err != nil || got != sum {
			t.Errorf("checksums.txt says %s has %s, it has %s (%v)", name, sum, got, err)
		}
	}
	for name := range files {
		if name != "checksums.txt" && !listed[name] {
			t.Errorf("checksums.txt does not list %s", name)
		}
	}

	// The SBOM is CycloneDX JSON naming kfn's module and what it links.
	var bom struct {
		BOMFormat string `json:"bomFormat"`
		Metadata  struct {
			Component struct{ Name, Version string }
		}
		Components []struct{ Name string }
	}
	data, err := os.ReadFile(bin + ".cdx.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &bom); err != nil {
		t.Fatalf("the SBOM is not JSON: %v", err)
	}
	if bom.BOMFormat != "CycloneDX" || bom.Metadata.Component.Name != "github.com/kfn-dev/kfn" || bom.Metadata.Component.Version != version {
		t.Errorf("the SBOM names %s %s %s, want CycloneDX github.com/kfn-dev/kfn %s", bom.BOMFormat, bom.Metadata.Component.Name, bom.Metadata.Component.Version, version)
	}
	pgx := false
	for _, c := range bom.Components {
		pgx = pgx || c.Name == "github.com/jackc/pgx/v5"
	}
	if !pgx {
		t.Errorf("the SBOM's %d components do not hold github.com/jackc/pgx/v5, which kfn links", len(bom.Components))
	}

	// Every image of the manifests is pinned to the release's version.
	manifests, err := os.ReadFile(filepath.Join(out, "kfn-kubernetes_"+version+".yaml"))
	if err != nil {
		t.Fatal(err)
	}
	images := regexp.MustCompile(`(?m)^\s*image: (\S+)$`).FindAllSubmatch(manifests, -1)
	if len(images) == 0 {
		t.Fatal("the manifests name no image")
	}
	for _, m := range images {
		if !strings.HasPrefix(string(m[1]), "ghcr.io/kfn-dev/kfn") || !strings.HasSuffix(string(m[1]), ":"+version) {
			t.Errorf("the manifests' image %s is not a kfn image of version %s", m[1], version)
		}
	}
}

func TestReleaseRefusesAnUntaggedCommit(t *testing.T) {
	t.Setenv("VERSION", "v99.0.0")
	err := run(context.Background(), []string{"--root", root, "--out", t.TempDir(), "--platforms", "linux/amd64"}, &bytes.Buffer{}, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "tag v99.0.0 is not HEAD") || !strings.Contains(err.Error(), "--snapshot") {
		t.Errorf("a release of an untagged commit: %v, want a refusal naming --snapshot", err)
	}
	t.Setenv("VERSION", "not a tag!")
	if err := run(context.Background(), []string{"--root", root, "--snapshot"}, &bytes.Buffer{}, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "cannot be an image tag") {
		t.Errorf("a version that cannot be an image tag: %v", err)
	}
}

func TestReleaseWithoutPodmanSaysSo(t *testing.T) {
	t.Setenv("VERSION", "v0.0.0-nopodman")
	r, err := newRelease(context.Background(), options{root: root, out: t.TempDir(), snapshot: true, platforms: []string{"linux/amd64"}, images: true}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", t.TempDir()) // no podman on it
	if err := r.build(context.Background()); err == nil || !strings.Contains(err.Error(), "podman is not installed") || !strings.Contains(err.Error(), "--no-images") {
		t.Errorf("a release with images and no podman: %v, want it to say so and name --no-images", err)
	}
}
