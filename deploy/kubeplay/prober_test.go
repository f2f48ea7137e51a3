//go:build container

package kubeplay

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os/exec"
	"slices"
	"strconv"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// prober runs a container's rendered probes the way the kubelet does,
// since podman 4.3 does not (readiness and startup probes are ignored, and
// the liveness probe becomes a health check this image cannot run; see
// the test's comment): each probe on its own ticker, every periodSeconds
// from the container's start after initialDelaySeconds, with
// timeoutSeconds (default 1 s); an HTTP GET succeeds on a status from 200
// to 399 (no keep-alive, as the kubelet's), a TCP probe when it connects,
// an exec probe when the command exits 0 (podman exec). Until the startup
// probe succeeds, the readiness and liveness probes are not run and the
// container is not ready; once it has, the readiness probe runs at once
// (the kubelet's prober manager triggers it while the container is not
// ready), then on its ticks. A result counts once it repeats
// successThreshold (default 1) or failureThreshold (default 3) times in a
// row: that many liveness or startup failures are a restart the kubelet
// would have made.
type prober struct {
	pod       pod
	container corev1.Container
	started   time.Time // the container's start
	podman    *podman

	mu        sync.Mutex
	startedUp time.Time   // when the startup probe succeeded (the start, without one)
	ready     bool        // the readiness probe's current result
	readyAt   time.Time   // when it first became ready
	unready   []time.Time // when it went from ready to not ready
	firstOK   time.Time   // when /readyz (the readiness probe's target) first answered 2xx/3xx, polled every 50 ms
	runs      map[string]int
	failures  map[string]int
	lastError map[string]string // each probe's last failure
	restarts  []string          // what the kubelet would have restarted the container for

	triggers map[string]chan struct{} // a probe's run between its ticks
	stop     chan struct{}
	wg       sync.WaitGroup
}

// startProber starts probing container name of p, which started at started.
func startProber(pm *podman, p pod, name string, started time.Time) *prober {
	pr := &prober{pod: p, started: started, podman: pm, runs: map[string]int{}, failures: map[string]int{}, lastError: map[string]string{}, stop: make(chan struct{}),
		triggers: map[string]chan struct{}{"startup": make(chan struct{}, 1), "readiness": make(chan struct{}, 1), "liveness": make(chan struct{}, 1)}}
	for _, c := range p.spec.Containers {
		if c.Name == name {
			pr.container = c
		}
	}
	c := pr.container
	if c.StartupProbe == nil {
		pr.startedUp = started
	}
	for kind, probe := range map[string]*corev1.Probe{"startup": c.StartupProbe, "readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
		if probe != nil {
			pr.wg.Add(1)
			go pr.loop(kind, probe)
		}
	}
	if c.ReadinessProbe != nil {
		pr.wg.Add(1)
		go pr.pollFirstOK(c.ReadinessProbe)
	}
	return pr
}

// close stops the probes (the pod was deleted or stopped).
func (pr *prober) close() {
	select {
	case <-pr.stop:
	default:
		close(pr.stop)
	}
	pr.wg.Wait()
}

// loop runs one probe on its ticker until close.
func (pr *prober) loop(kind string, p *corev1.Probe) {
	defer pr.wg.Done()
	period := time.Duration(orDefault(p.PeriodSeconds, 10)) * time.Second
	first := pr.started.Add(time.Duration(p.InitialDelaySeconds) * time.Second)
	successes, failures := 0, 0
	for k := 0; ; {
		if time.Until(first.Add(time.Duration(k+1)*period)) <= 0 {
			k++
			continue // a tick a whole period before the prober started
		}
		// A tick the prober started late for runs at once.
		select {
		case <-pr.stop:
			return
		case <-time.After(time.Until(first.Add(time.Duration(k) * period))):
			k++
		case <-pr.triggers[kind]: // between ticks
		}
		pr.mu.Lock()
		gated := kind != "startup" && pr.startedUp.IsZero()
		done := kind == "startup" && !pr.startedUp.IsZero()
		pr.mu.Unlock()
		if done {
			return // the kubelet stops the startup probe once it succeeded
		}
		if gated {
			continue
		}
		err := pr.probe(p)
		now := time.Now()
		if err == nil {
			successes, failures = successes+1, 0
		} else {
			successes, failures = 0, failures+1
		}
		pr.mu.Lock()
		pr.runs[kind]++
		if err != nil {
			pr.failures[kind]++
			pr.lastError[kind] = err.Error()
		}
		switch kind {
		case "startup":
			if err == nil {
				pr.startedUp = now
				// The kubelet runs the readiness probe at once when the
				// container has started and is not ready yet.
				select {
				case pr.triggers["readiness"] <- struct{}{}:
				default:
				}
			} else if failures == int(orDefault(p.FailureThreshold, 3)) {
				pr.restarts = append(pr.restarts, fmt.Sprintf("startup probe failed %d times in a row (last: %v)", failures, err))
			}
		case "readiness":
			if err == nil && successes >= int(orDefault(p.SuccessThreshold, 1)) && !pr.ready {
				pr.ready = true
				if pr.readyAt.IsZero() {
					pr.readyAt = now
				}
			}
			if err != nil && failures >= int(orDefault(p.FailureThreshold, 3)) && pr.ready {
				pr.ready = false
				pr.unready = append(pr.unready, now)
			}
		case "liveness":
			if err != nil && failures == int(orDefault(p.FailureThreshold, 3)) {
				pr.restarts = append(pr.restarts, fmt.Sprintf("liveness probe failed %d times in a row at %s (last: %v)", failures, now.Format(time.TimeOnly), err))
			}
		}
		pr.mu.Unlock()
	}
}

// pollFirstOK asks the readiness probe's target every 50 ms until it first
// succeeds: when the process was ready, against which the probe's period
// shows.
func (pr *prober) pollFirstOK(p *corev1.Probe) {
	defer pr.wg.Done()
	for {
		if pr.probe(p) == nil {
			pr.mu.Lock()
			pr.firstOK = time.Now()
			pr.mu.Unlock()
			return
		}
		select {
		case <-pr.stop:
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// probe runs p once against the pod, as the kubelet would.
func (pr *prober) probe(p *corev1.Probe) error {
	timeout := time.Duration(orDefault(p.TimeoutSeconds, 1)) * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	switch h := p.ProbeHandler; {
	case h.HTTPGet != nil:
		port, err := pr.port(h.HTTPGet.Port.String(), h.HTTPGet.Port.IntValue())
		if err != nil {
			return err
		}
		scheme := "http"
		if h.HTTPGet.Scheme == corev1.URISchemeHTTPS {
			scheme = "https"
		}
		host := h.HTTPGet.Host
		if host == "" {
			host = "127.0.0.1" // the pod's IP: the host's, on the host network
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, scheme+"://"+net.JoinHostPort(host, strconv.Itoa(port))+h.HTTPGet.Path, nil)
		if err != nil {
			return err
		}
		req.Header.Set("User-Agent", "kube-probe/kfn-kubeplay")
		for _, hd := range h.HTTPGet.HTTPHeaders {
			req.Header.Set(hd.Name, hd.Value)
		}
		req.Close = true
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode < 200 || resp.StatusCode >= 400 {
			return fmt.Errorf("GET %s: %s", h.HTTPGet.Path, resp.Status)
		}
		return nil
	case h.TCPSocket != nil:
		port, err := pr.port(h.TCPSocket.Port.String(), h.TCPSocket.Port.IntValue())
		if err != nil {
			return err
		}
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			return err
		}
		return conn.Close()
	case h.Exec != nil:
		args := append(pr.podman.Args("exec", pr.pod.container(pr.container.Name)), h.Exec.Command...)
		if out, err := exec.CommandContext(ctx, "podman", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("exec %v: %v: %s", h.Exec.Command, err, out)
		}
		return nil
	default:
		return errors.New("a probe kind this prober does not run (gRPC)")
	}
}

// port resolves a probe's port: a number, or the name of a container port.
func (pr *prober) port(text string, number int) (int, error) {
	if number != 0 {
		return number, nil
	}
	for _, p := range pr.container.Ports {
		if p.Name == text {
			return int(p.ContainerPort), nil
		}
	}
	return 0, fmt.Errorf("container %s has no port named %q", pr.container.Name, text)
}

// probeState is a copy of what the probes found.
type probeState struct {
	startedUp, readyAt, firstOK time.Time
	ready                       bool
	unready                     []time.Time
	runs, failures              map[string]int
	lastError                   map[string]string
	restarts                    []string
}

func (pr *prober) state() probeState {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	return probeState{startedUp: pr.startedUp, readyAt: pr.readyAt, firstOK: pr.firstOK, ready: pr.ready,
		unready: slices.Clone(pr.unready), restarts: slices.Clone(pr.restarts),
		runs: maps.Clone(pr.runs), failures: maps.Clone(pr.failures), lastError: maps.Clone(pr.lastError)}
}

func orDefault(v, d int32) int32 {
	if v == 0 {
		return d
	}
	return v
}
