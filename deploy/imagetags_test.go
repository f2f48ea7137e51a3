package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"testing"
)

// TestBaseManifestsLeaveImageTagsToKustomize checks that the base names
// kfn's images without a tag or digest: the version comes from one place,
// kustomize's images transformer (an overlay's images:, or the release's
// rendered manifests, where go tool task release sets it), never from a
// version written by hand into a Deployment.
func TestBaseManifestsLeaveImageTagsToKustomize(t *testing.T) {
	files, err := filepath.Glob("kubernetes/base/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests under deploy/kubernetes/base (%v)", err)
	}
	image := regexp.MustCompile(`(?m)^\s*image:\s*(\S+)`)
	untagged := regexp.MustCompile(`^ghcr\.io/kfn-dev/kfn(-[a-z0-9-]+)?$`)
	seen := 0
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range image.FindAllSubmatch(data, -1) {
			seen++
			if !untagged.Match(m[1]) {
				t.Errorf("%s: image %s: want a kfn image without a tag (ghcr.io/kfn-dev/kfn-NAME); the overlay or the release sets the tag", f, m[1])
			}
		}
	}
	if seen == 0 {
		t.Error("the base names no image")
	}
}
