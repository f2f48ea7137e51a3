//go:build container

package kubeplay

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/kfn-dev/kfn/internal/podmantest"
)

// podman is podman for this run: it removes everything the run made when
// the test ends (its pods, containers, secrets, volumes and images,
// checked by listing).
type podman struct {
	*podmantest.Podman
	t   *testing.T
	run string // in the name of everything this run makes

	mu         sync.Mutex
	pods       []string
	containers []string
	secrets    []string
	images     []string // ids
}

func newPodman(t *testing.T, run string) *podman {
	t.Helper()
	pm := &podman{Podman: podmantest.New(t, "../.."), t: t, run: run}
	t.Cleanup(pm.cleanup)
	return pm
}

// buildImage builds the main package pkg (relative to the repository) into
// localhost/name:kubeplay-RUN with deploy/image.sh, as users build images.
func (pm *podman) buildImage(pkg, name string) string {
	pm.t.Helper()
	tag := "kubeplay-" + pm.run
	pm.BuildImage(filepath.Join(pm.Root, pkg), name, "VERSION="+tag)
	ref := "localhost/" + name + ":" + tag
	id := pm.Run("image", "inspect", "--format", "{{.Id}}", ref)
	pm.mu.Lock()
	pm.images = append(pm.images, id)
	pm.mu.Unlock()
	return ref
}

// createSecret stores a Secret's values as podman kube play's secret
// volumes read them: a YAML document whose data holds each value as it
// is (podman 4.3.1 writes data's strings to the volume's files as they
// are stored, and a played Secret is stored base64-encoded).
func (pm *podman) createSecret(name string, values map[string]string) {
	pm.t.Helper()
	doc, err := yaml.Marshal(map[string]any{"data": values})
	if err != nil {
		pm.t.Fatal(err)
	}
	pm.mu.Lock()
	pm.secrets = append(pm.secrets, name) // its volume has its name too
	pm.mu.Unlock()
	cmd := pm.Command("secret", "create", name, "-")
	cmd.Stdin = bytes.NewReader(doc)
	if out, err := cmd.CombinedOutput(); err != nil {
		pm.t.Fatalf("podman secret create %s: %v\n%s", name, err, out)
	}
}

// willRun records pods and containers this run is about to make, so that
// cleanup removes them however the test ends.
func (pm *podman) willRun(pods, containers []string) {
	pm.mu.Lock()
	defer pm.mu.Unlock()
	pm.pods = append(pm.pods, pods...)
	pm.containers = append(pm.containers, containers...)
}

// cleanup removes what this run made, at once (no grace: the test is
// over), and fails the test if any of it is left.
func (pm *podman) cleanup() {
	pm.mu.Lock()
	pods, containers, secrets, images := pm.pods, pm.containers, pm.secrets, pm.images
	pm.mu.Unlock()
	if pm.t.Failed() {
		for _, p := range pods {
			pm.t.Logf("last log lines of %s:\n%s", p+"-kfn", pm.Logs(p+"-kfn", 40))
		}
	}
	// One at a time: podman removes none of a list that names a missing one.
	quiet := func(a ...string) { _ = pm.Command(a...).Run() }
	for _, p := range pods {
		quiet("pod", "rm", "--ignore", "-f", "-t", "0", p)
	}
	for _, c := range containers {
		quiet("rm", "--ignore", "-f", "-t", "0", c)
	}
	for _, s := range secrets {
		quiet("secret", "rm", s)
		quiet("volume", "rm", "-f", s)
	}
	for _, id := range images {
		quiet("rmi", "-f", id)
	}
	// Nothing of this run's may be left.
	mine := func(name string) bool { return strings.Contains(name, "-"+pm.run) }
	for _, list := range [][]string{
		{"pod", "ps", "--format", "{{.Name}}"},
		{"ps", "-a", "--format", "{{.Names}}"},
		{"secret", "ls", "--format", "{{.Name}}"},
		{"volume", "ls", "--format", "{{.Name}}"},
		{"images", "--format", "{{.Repository}}:{{.Tag}}"},
	} {
		out, err := pm.Command(list...).Output()
		if err != nil {
			pm.t.Errorf("podman %s: %v", strings.Join(list, " "), err)
			continue
		}
		if left := slices.DeleteFunc(strings.Fields(string(out)), func(n string) bool { return !mine(n) }); len(left) > 0 {
			pm.t.Errorf("podman %s: left after the test: %v", list[0], left)
		}
	}
}

// play plays the rewritten overlay with podman kube play --network host,
// and starts probing each pod's container kfn as soon as it runs (podman
// starts a file's pods one after another, and returns once all started).
// It returns the probers and how long kube play took.
func play(t *testing.T, pm *podman, p played) (map[string]*prober, time.Duration) {
	t.Helper()
	file := filepath.Join(t.TempDir(), "kfn-example.yaml")
	if err := os.WriteFile(file, p.yaml(), 0o600); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	played := make(chan struct{})
	probing := make(chan *prober, len(p.pods))
	for _, pd := range p.pods {
		go func() { probing <- pm.probeWhenRunning(pd, "kfn", played) }()
	}
	out, err := pm.Command("kube", "play", "--network", "host", file).CombinedOutput()
	took := time.Since(start)
	close(played)
	probers := map[string]*prober{}
	for range p.pods {
		if pr := <-probing; pr != nil {
			probers[pr.pod.name] = pr
		}
	}
	t.Cleanup(func() {
		for _, pr := range probers {
			pr.close()
		}
	})
	if err != nil {
		t.Fatalf("podman kube play --network host %s: %v\n%s", file, err, out)
	}
	for _, pd := range p.pods {
		if probers[pd.name] == nil {
			t.Fatalf("kube play returned, but container %s does not run:\n%s", pd.container("kfn"), pm.Logs(pd.container("kfn"), 30))
		}
	}
	return probers, took
}

// probeWhenRunning waits until container c of pod pd runs (asking podman
// every 100 ms) and starts probing it; it gives up, returning nil, once
// played is closed and the container does not run.
func (pm *podman) probeWhenRunning(pd pod, c string, played <-chan struct{}) *prober {
	over := false
	for {
		out, err := pm.Command("inspect", "--format", "{{.State.Running}} {{.State.StartedAt.UnixNano}}", pd.container(c)).Output()
		if running, ns, ok := strings.Cut(strings.TrimSpace(string(out)), " "); err == nil && ok && running == "true" {
			if n, err := strconv.ParseInt(ns, 10, 64); err == nil {
				return startProber(pm, pd, c, time.Unix(0, n))
			}
		}
		if over {
			return nil
		}
		select {
		case <-played:
			over = true // one more look: it may have started at the end
		case <-time.After(100 * time.Millisecond):
		}
	}
}
