package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
)

// image builds one image with deploy/image.sh (FROM scratch, a static
// binary stamped like the CLI's, OCI labels for the version, commit,
// build time and source), saves it as an OCI archive and writes the SBOM of
// the binary inside it. The images are built for this machine's
// architecture (linux/GOARCH).
func (r *release) image(ctx context.Context, name, pkg string) error {
	ref := r.registry + "/" + name
	base := filepath.Join(r.out, fmt.Sprintf("%s-image_%s_linux_%s.oci.tar", name, r.version, runtime.GOARCH))
	fmt.Fprintf(r.log, "image %s:%s\n", ref, r.version)
	env := []string{"VERSION=" + r.version, "COMMIT=" + r.commit, "BUILD_TIME=" + r.built}
	if os.Getenv("CONTAINERS_CONF") == "" { // podman on these machines: see deploy/containers.conf
		env = append(env, "CONTAINERS_CONF="+filepath.Join(r.root, "deploy", "containers.conf"))
	}
	if err := r.cmd(ctx, env, "bash", "deploy/image.sh", pkg, ref); err != nil {
		return err
	}
	tagged := ref + ":" + r.version
	if err := r.cmd(ctx, env, "podman", "save", "-q", "--format", "oci-archive", "-o", base, tagged); err != nil {
		return err
	}
	// The SBOM describes what the image runs: its own /function.
	tmp, err := os.MkdirTemp("", "kfn-release-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	out, err := exec.CommandContext(ctx, "podman", "create", tagged).Output()
	if err != nil {
		return fmt.Errorf("podman create %s: %w", tagged, err)
	}
	ctr := strings.TrimSpace(string(out))
	defer exec.Command("podman", "rm", "-f", ctr).Run()
	bin := filepath.Join(tmp, name)
	if err := r.cmd(ctx, env, "podman", "cp", ctr+":/function", bin); err != nil {
		return err
	}
	return r.sbom(ctx, bin, base+".cdx.json")
}
