// Command release builds a kfn release into one folder: the kfn CLI for
// each platform, the function images (podman, OCI labels), a CycloneDX
// SBOM for every binary and image, the Kubernetes manifests with the
// release's image tags, and checksums.txt (SHA-256 of every other file).
// Every binary is stamped with the version, the commit and the build time
// (internal/buildinfo), which its --version prints.
//
//	go tool task release                    # HEAD must be a clean vX.Y.Z tag
//	go tool task release -- --snapshot      # any commit, dirty or not
//	go tool task release:snapshot -- --platforms linux/amd64 --no-images
//
// Why not GoReleaser, the ecosystem's convention: tried once (v2.17.0, the
// only kind of version served here being an unapproved earlier copy), `go
// get -tool` added about 360 modules to the tools module (the cloud SDKs of
// its publishers), and its build had not finished after 15 minutes on a
// 2-core machine; its podman backend for images is a GoReleaser Pro
// feature, and these machines have podman, not docker. What kfn needs of it
// (cross builds, stamps, checksums, SBOMs, images, rendered manifests) is
// this small program; its snapshot test runs in go tool task test.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "release: %v\n", err)
		os.Exit(1)
	}
}

// defaultPlatforms are the kfn CLI's release platforms.
const defaultPlatforms = "linux/amd64,linux/arm64,darwin/arm64,darwin/amd64"

// options are the command line's.
type options struct {
	root      string   // the checkout
	out       string   // the release folder, emptied first
	snapshot  bool     // any commit: no tag or clean tree needed
	platforms []string // GOOS/GOARCH of the kfn CLI
	images    bool     // build the function images with podman
	registry  string   // the images' repository prefix
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("release", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o options
	var platforms string
	var noImages bool
	fs.StringVar(&o.root, "root", ".", "the kfn checkout to release")
	fs.StringVar(&o.out, "out", "dist", "the release folder (emptied first), relative to --root")
	fs.BoolVar(&o.snapshot, "snapshot", false, "release any commit (version: git describe --tags --always --dirty, or $VERSION); without it HEAD must be a clean vX.Y.Z tag")
	fs.StringVar(&platforms, "platforms", defaultPlatforms, "GOOS/GOARCH list of the kfn CLI's builds")
	fs.BoolVar(&noImages, "no-images", false, "skip the function images (for machines without podman)")
	fs.StringVar(&o.registry, "registry", "ghcr.io/kfn-dev", "the images' repository prefix, as the manifests name them")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: go tool task release [-- flags] (or release:snapshot)\n\n"+
			"Builds kfn for each platform, the function images, an SBOM per binary and image, the\n"+
			"Kubernetes manifests with the release's image tags, and checksums.txt into --out.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q (see -h)", fs.Arg(0))
	}
	for _, p := range strings.Split(platforms, ",") {
		if p = strings.TrimSpace(p); p != "" {
			o.platforms = append(o.platforms, p)
		}
	}
	o.images = !noImages
	r, err := newRelease(ctx, o, stderr)
	if err != nil {
		return err
	}
	if err := r.build(ctx); err != nil {
		return err
	}
	return r.list(stdout)
}
