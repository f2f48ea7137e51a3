package main

import (
	"context"
	"fmt"
	"io"
	goruntime "runtime"
	"runtime/debug"
	"strings"

	"github.com/kfn-dev/kfn/internal/schema"
)

// runVersion prints the version of kfn's module this binary was built from,
// its VCS revision and time when the build recorded them, the Go version
// and the schema version it is built for.
func runVersion(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("version", help{
		usage: []string{"kfn version"},
		text: `
Prints the kfn module version this binary was built from, its VCS revision
and time when the build recorded them, the Go version, and the schema
version it is built for (see Upgrades in the README).`,
		examples: "kfn version",
	}, stderr)
	if err := parse(fs, args); err != nil {
		return err
	}
	bi, _ := debug.ReadBuildInfo()
	if _, err := io.WriteString(stdout, versionText(bi)); err != nil {
		return err
	}
	_, err := fmt.Fprintf(stdout, "schema   %d (workers built for schema %d or later run against it)\n", schema.Latest(), schema.OldestCompatible())
	return err
}

// versionText formats bi (nil when the binary has no build information).
func versionText(bi *debug.BuildInfo) string {
	version, goVersion := "", goruntime.Version()
	var revision, at string
	modified := false
	if bi != nil {
		version = bi.Main.Version
		if bi.GoVersion != "" {
			goVersion = bi.GoVersion
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				revision = s.Value
			case "vcs.time":
				at = s.Value
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
	}
	if version == "" {
		version = "(devel)"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "kfn %s\n", version)
	if revision != "" {
		if modified {
			revision += " (with uncommitted changes)"
		}
		fmt.Fprintf(&b, "revision %s\n", revision)
	}
	if at != "" {
		fmt.Fprintf(&b, "time     %s\n", at)
	}
	fmt.Fprintf(&b, "go       %s %s/%s\n", goVersion, goruntime.GOOS, goruntime.GOARCH)
	return b.String()
}
