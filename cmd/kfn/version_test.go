package main

import (
	"fmt"
	goruntime "runtime"
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
	if code, dashed, stderr := kfn(t, "--version"); code != 0 || dashed != out {
		t.Errorf("kfn --version: exit %d, out %q (kfn version: %q), err %q", code, dashed, out, stderr)
	}
	if code, _, stderr := kfn(t, "version", "extra"); code != 2 || !strings.Contains(stderr, `unexpected argument "extra"`) {
		t.Errorf("kfn version extra: exit %d, %q", code, stderr)
	}
	if code, help, _ := kfn(t, "version", "-h"); code != 0 || !strings.Contains(help, "usage: kfn version") {
		t.Errorf("kfn version -h: exit %d, %q", code, help)
	}
	if _, _, usage := kfn(t); !strings.Contains(usage, "  version  print kfn's version") || !strings.Contains(usage, "kfn --version") {
		t.Errorf("the usage does not list version and --version:\n%s", usage)
	}
}
