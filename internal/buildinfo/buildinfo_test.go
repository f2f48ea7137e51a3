package buildinfo

import (
	"runtime/debug"
	"strings"
	"testing"
)

func TestStampedValuesWinOverTheToolchainsRecord(t *testing.T) {
	bi := &debug.BuildInfo{GoVersion: "go1.99.1", Main: debug.Module{Path: Module, Version: "v0.0.0-20261204-abcdef"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc123"}, {Key: "vcs.time", Value: "2026-09-01T10:00:00Z"}, {Key: "vcs.modified", Value: "true"}}}
	in := fromBuild(bi, "v1.2.3", "fedcba", "2026-12-04T19:00:00Z")
	if in.Version != "v1.2.3" || in.Commit != "fedcba" || in.Time != "2026-12-04T19:00:00Z" || in.TimeIsCommit || in.Go != "go1.99.1" {
		t.Errorf("stamped: %+v", in)
	}
	text := in.Text("orders")
	for _, want := range []string{"orders v1.2.3\n", "commit   fedcba (with uncommitted changes)\n", "built    2026-12-04T19:00:00Z\n", "go       go1.99.1 "} {
		if !strings.Contains(text, want) {
			t.Errorf("Text lacks %q:\n%s", want, text)
		}
	}
}

func TestUnstampedBuildReportsTheToolchainsRecord(t *testing.T) {
	bi := &debug.BuildInfo{GoVersion: "go1.99.1", Main: debug.Module{Path: Module, Version: "v0.0.0-20261204-abcdef"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc123"}, {Key: "vcs.time", Value: "2026-09-01T10:00:00Z"}}}
	in := fromBuild(bi, "", "", "")
	if in.Version != "v0.0.0-20261204-abcdef" || in.Commit != "abc123" || in.Time != "2026-09-01T10:00:00Z" || !in.TimeIsCommit || in.Modified {
		t.Errorf("from the build info: %+v", in)
	}
	if text := in.Text("kfn"); !strings.Contains(text, "time     2026-09-01T10:00:00Z (the commit's") {
		t.Errorf("Text does not say the time is the commit's:\n%s", text)
	}
	devel := fromBuild(&debug.BuildInfo{Main: debug.Module{Path: Module, Version: "(devel)"}}, "", "", "")
	if got := devel.Text("kfn"); !strings.HasPrefix(got, "kfn (devel)\ngo       ") {
		t.Errorf("without VCS information: %q", got)
	}
	if got := fromBuild(nil, "", "", "").Text("kfn"); !strings.HasPrefix(got, "kfn (devel)\ngo       ") {
		t.Errorf("without build information: %q", got)
	}
}

func TestAFunctionModuleReportsKfnsVersionToo(t *testing.T) {
	bi := &debug.BuildInfo{Main: debug.Module{Path: "example.com/shop", Version: "v2.0.0"},
		Deps: []*debug.Module{{Path: "github.com/jackc/pgx/v5", Version: "v5.13.0"}, {Path: Module, Version: "v0.3.0"}}}
	in := fromBuild(bi, "", "", "")
	if in.Version != "v2.0.0" || in.Kfn != "v0.3.0" || !strings.Contains(in.Text("shop"), "kfn      v0.3.0\n") {
		t.Errorf("a function module: %+v\n%s", in, in.Text("shop"))
	}
}

func TestRequested(t *testing.T) {
	for _, c := range []struct {
		args []string
		want bool
	}{
		{[]string{"--version"}, true},
		{[]string{"-version"}, true},
		{[]string{"migrate", "--version"}, true},
		{nil, false},
		{[]string{"migrate"}, false},
		{[]string{"--database-url", "--version"}, false}, // a flag's value
		{[]string{"migrate", "--database-url", "x", "--version"}, false},
		{[]string{"--versions"}, false},
	} {
		if got := Requested(c.args); got != c.want {
			t.Errorf("Requested(%q) = %v, want %v", c.args, got, c.want)
		}
	}
}
