package main

import (
	"fmt"
	goruntime "runtime"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/internal/schema"
)

func TestVersionPrintsModuleRevisionAndGo(t *testing.T) {
	code, out, stderr := kfn(t, "version")
	if code != 0 || !strings.HasPrefix(out, "kfn ") || !strings.Contains(out, "go       "+goruntime.Version()+" "+goruntime.GOOS+"/"+goruntime.GOARCH+"\n") ||
		!strings.Contains(out, fmt.Sprintf("schema   %d (workers built for schema %d or later run against it)\n", schema.Latest(), schema.OldestCompatible())) {
		t.Errorf("kfn version: exit %d, out %q, err %q", code, out, stderr)
	}
	if code, _, stderr := kfn(t, "version", "extra"); code != 2 || !strings.Contains(stderr, `unexpected argument "extra"`) {
		t.Errorf("kfn version extra: exit %d, %q", code, stderr)
	}
	if code, help, _ := kfn(t, "version", "-h"); code != 0 || !strings.Contains(help, "usage: kfn version") {
		t.Errorf("kfn version -h: exit %d, %q", code, help)
	}
	if _, _, usage := kfn(t); !strings.Contains(usage, "  version  print kfn's version") {
		t.Errorf("the usage does not list version:\n%s", usage)
	}

	bi := &debug.BuildInfo{GoVersion: "go1.99.1", Main: debug.Module{Path: "github.com/kfn-dev/kfn", Version: "v1.2.3"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc123"}, {Key: "vcs.time", Value: "2026-09-01T10:00:00Z"}, {Key: "vcs.modified", Value: "true"}}}
	want := fmt.Sprintf("kfn v1.2.3\nrevision abc123 (with uncommitted changes)\ntime     2026-09-01T10:00:00Z\ngo       go1.99.1 %s/%s\n", goruntime.GOOS, goruntime.GOARCH)
	if got := versionText(bi); got != want {
		t.Errorf("versionText = %q, want %q", got, want)
	}
	devel := &debug.BuildInfo{GoVersion: "go1.99.1", Main: debug.Module{Path: "github.com/kfn-dev/kfn", Version: "(devel)"}}
	if got := versionText(devel); !strings.HasPrefix(got, "kfn (devel)\ngo ") {
		t.Errorf("versionText without VCS = %q", got)
	}
	if got := versionText(nil); !strings.HasPrefix(got, "kfn (devel)\ngo       "+goruntime.Version()) {
		t.Errorf("versionText(nil) = %q", got)
	}
}
