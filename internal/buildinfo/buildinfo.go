// Package buildinfo owns what a kfn binary says about its own build: the
// module version, the VCS commit and the build time that `kfn version`,
// `kfn --version` and a function binary's --version print. A release or
// image build stamps them with the linker (-ldflags "-X
// github.com/kfn-dev/kfn/internal/buildinfo.version=v0.1.0", and .commit
// and .date likewise); a plain `go build` from a checkout leaves them empty, and
// then the Go toolchain's own record is read instead (debug.ReadBuildInfo:
// the main module's version and vcs.revision, vcs.time, vcs.modified). It
// imports nothing of kfn's, so that the CLI and the engine can share it.
package buildinfo

import (
	"fmt"
	goruntime "runtime"
	"runtime/debug"
	"strings"
)

// Stamped by the linker (-X); empty in a plain go build.
var (
	version string // the release version: v0.1.0, or git describe's output for a snapshot
	commit  string // the full VCS revision
	date    string // the build time, RFC 3339 UTC
)

// Module is kfn's module path: the module whose version a function built in
// another module (kfn new) reports beside its own.
const Module = "github.com/kfn-dev/kfn"

// Info is what a binary knows about its build.
type Info struct {
	Version string // stamped, else the main module's version from the Go toolchain, else "(devel)"
	Commit  string // stamped, else vcs.revision; "" when unknown
	Time    string // the build time when stamped, else the commit time (vcs.time); "" when unknown
	// TimeIsCommit says Time is vcs.time, the commit's time, not the build's.
	TimeIsCommit bool
	Modified     bool   // vcs.modified: built from a tree with uncommitted changes
	Kfn          string // kfn's module version when the main module is another one (a function module); else ""
	Go           string // the Go version it was built with
	Platform     string // GOOS/GOARCH
}

// Read returns this binary's Info.
func Read() Info {
	bi, _ := debug.ReadBuildInfo()
	return fromBuild(bi, version, commit, date)
}

// fromBuild is Read on given build information and stamped values.
func fromBuild(bi *debug.BuildInfo, version, commit, date string) Info {
	in := Info{Version: version, Commit: commit, Time: date, Go: goruntime.Version(), Platform: goruntime.GOOS + "/" + goruntime.GOARCH}
	if bi != nil {
		if bi.GoVersion != "" {
			in.Go = bi.GoVersion
		}
		if in.Version == "" {
			in.Version = bi.Main.Version
		}
		if bi.Main.Path != Module {
			for _, d := range bi.Deps {
				if d.Path == Module {
					in.Kfn = d.Version
					if d.Replace != nil {
						in.Kfn += " => " + d.Replace.Path + " " + d.Replace.Version
					}
				}
			}
		}
		var revision, at string
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				revision = s.Value
			case "vcs.time":
				at = s.Value
			case "vcs.modified":
				in.Modified = s.Value == "true"
			}
		}
		if in.Commit == "" {
			in.Commit = revision
		}
		if in.Time == "" && at != "" {
			in.Time, in.TimeIsCommit = at, true
		}
	}
	if in.Version == "" {
		in.Version = "(devel)"
	}
	return in
}

// Text is Info as the lines --version prints, the first naming the binary:
//
//	orders v0.1.0
//	commit 0f5532b7c1…
//	built  2026-12-04T19:00:00Z
//	go     go1.26.8 linux/amd64
func (in Info) Text(name string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s\n", name, in.Version)
	if in.Kfn != "" {
		fmt.Fprintf(&b, "kfn      %s\n", in.Kfn)
	}
	if in.Commit != "" {
		c := in.Commit
		if in.Modified {
			c += " (with uncommitted changes)"
		}
		fmt.Fprintf(&b, "commit   %s\n", c)
	}
	if in.Time != "" {
		if in.TimeIsCommit {
			fmt.Fprintf(&b, "time     %s (the commit's; a build stamped by go tool task build or release has its build time)\n", in.Time)
		} else {
			fmt.Fprintf(&b, "built    %s\n", in.Time)
		}
	}
	fmt.Fprintf(&b, "go       %s %s\n", in.Go, in.Platform)
	return b.String()
}

// Requested says whether args ask for the version: --version or -version
// as the first argument, or right after a mode such as migrate.
func Requested(args []string) bool {
	for i, a := range args {
		if a == "--version" || a == "-version" {
			return true
		}
		if i > 0 || strings.HasPrefix(a, "-") {
			return false
		}
	}
	return false
}
