package main

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// manifests renders deploy/kubernetes/base with kustomize's images
// transformer setting every kfn image to the release's tag (and --registry),
// into kfn-kubernetes_VERSION.yaml: the committed manifests name the images
// and carry no version of their own. The Secrets are the installation's own
// (deploy/kubernetes/overlays/example shows them), so they are not in it.
func (r *release) manifests() error {
	mem := filesys.MakeFsInMemory()
	src := filepath.Join(r.root, "deploy", "kubernetes")
	err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, path)
		return mem.WriteFile("/kubernetes/"+filepath.ToSlash(rel), data)
	})
	if err != nil {
		return fmt.Errorf("read the manifests: %w", err)
	}
	var k strings.Builder
	k.WriteString("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [../kubernetes/base]\nimages:\n")
	for _, f := range functions {
		fmt.Fprintf(&k, "  - { name: ghcr.io/kfn-dev/%s, newName: %s/%s, newTag: %q }\n", f.name, r.registry, f.name, r.version)
	}
	if err := mem.WriteFile("/release/kustomization.yaml", []byte(k.String())); err != nil {
		return err
	}
	rm, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(mem, "/release")
	if err != nil {
		return fmt.Errorf("render the manifests (kustomize): %w", err)
	}
	out, err := rm.AsYaml()
	if err != nil {
		return err
	}
	head := fmt.Sprintf("# kfn %s (commit %s): deploy/kubernetes/base with the release's images.\n"+
		"# Make the Secrets kfn-database, kfn-migrator and kfn-kafka first (see\n"+
		"# deploy/kubernetes/overlays/example), then: kubectl apply -n NAMESPACE -f this file.\n", r.version, r.commit)
	fmt.Fprintf(r.log, "manifests kfn-kubernetes_%s.yaml\n", r.version)
	return os.WriteFile(filepath.Join(r.out, fmt.Sprintf("kfn-kubernetes_%s.yaml", r.version)), append([]byte(head), out...), 0o644)
}
