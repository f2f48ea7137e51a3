package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestReferencesAreCurrent renders both references from the code, in
// memory, and fails when a committed one differs: a flag, a command or a
// setting was changed without `go generate ./...`.
func TestReferencesAreCurrent(t *testing.T) {
	root, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	kfn, err := buildKFN(root, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	refs, err := render(kfn)
	if err != nil {
		t.Fatal(err)
	}
	for path, want := range refs {
		got, err := os.ReadFile(filepath.Join(root, path))
		if err != nil {
			t.Errorf("%s: %v; run `go generate ./...` and commit it", path, err)
			continue
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s is stale: run `go generate ./...` and commit it; first difference:\n%s", path, firstDifference(string(got), string(want)))
		}
	}
}

// firstDifference shows the first line where the committed text (got)
// and the generated one (want) differ.
func firstDifference(got, want string) string {
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := 0; i < len(g) || i < len(w); i++ {
		var gl, wl string
		if i < len(g) {
			gl = g[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if gl != wl {
			return fmt.Sprintf("line %d:\n  committed: %s\n  generated: %s", i+1, gl, wl)
		}
	}
	return "(none: the lines are equal)"
}
