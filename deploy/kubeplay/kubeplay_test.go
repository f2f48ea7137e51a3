//go:build container

package kubeplay

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

const (
	// ordersReplicas stands in for KEDA, which owns the orders
	// Deployment's replicas: three workers share the topic.
	ordersReplicas = 3
	// partitions is the orders topic's (keda.yaml's maxReplicaCount).
	partitions = 12
	// produced orders at rate keep the topic under load from the pods'
	// readiness through both faults (about 45 s); the test fails if
	// production ended before the graceful stop.
	produced = 13500
	rate     = 300
	// readyLimit bounds the wait for every pod's readiness probe.
	readyLimit = 3 * time.Minute
)

// The example overlay (deploy/kubernetes/overlays/example), rendered with
// kustomize as users apply it, played by `podman --runtime runc kube play
// --network host` with images this machine builds (deploy/image.sh, FROM
// scratch) against this test's Postgres, a 3-node NATS cluster and Kafka
// on 127.0.0.1:
//
//   - Every pod becomes ready through its readiness probe: time to ready.
//   - kfn produce (in the kfn image) feeds the orders topic, 12
//     partitions, while three orders pods share it.
//   - One orders pod is deleted by force (podman pod rm -f -t 0: SIGKILL,
//     no grace, as `kubectl delete pod --grace-period=0 --force`): the
//     others claim its partitions once its leases expire, within the lease
//     TTL + 2 s (the liveness tests' bound; the lease outlives its last
//     renewal by the TTL, and the watch and the claim add milliseconds).
//   - Another is stopped with its grace period (podman pod stop -t 45, the
//     rendered terminationGracePeriodSeconds): it exits 0 and the last pod
//     claims its partitions well before the TTL (released, not expired);
//     the handoff stall is the gap, per partition, between the last batch
//     of the old term and the first of the new one, and the offsets must
//     follow on across it.
//   - Every order is applied exactly once (one orders row per order with
//     one revision, one inbox row per record, no dead letter), and every
//     orders.accepted event reaches the ledger pods once (one event inbox
//     row per order, two ledger entries each) through the relay pods,
//     whose outbox is drained.
//
// What podman 4.3.1 (Debian 12) does with the rendered pods, read from its
// source and checked here:
//
//   - readinessProbe and startupProbe: ignored (its kube support table
//     lists neither). livenessProbe: turned into a podman health check,
//     `CMD-SHELL curl -f http://localhost:0/healthz || exit 1` (the named
//     port is not resolved), which needs /bin/sh and curl, neither in a
//     FROM scratch or distroless image, and runs from systemd timers, which
//     these hosts do not have (podman logs that and runs the container).
//     On a host with systemd it would fail, and restartPolicy Always
//     makes podman restart the container on it. So this test probes as
//     the kubelet would (prober): each rendered probe, as rendered, over
//     HTTP against the pod; readiness counts only after the startup
//     probe, and a liveness or startup failure streak that would make the
//     kubelet restart the container fails the test.
//   - terminationGracePeriodSeconds: ignored (podman's stop timeout stays
//     10 s), so the test passes the rendered grace to podman pod stop -t.
//   - The pod's runAsNonRoot, fsGroup and seccompProfile: ignored (the
//     containers' runAsUser/runAsGroup, readOnlyRootFilesystem,
//     allowPrivilegeEscalation and capabilities are applied; podman's
//     default seccomp profile applies); init containers run to completion
//     before the pod's containers, but under the pod's restartPolicy
//     (below).
//
// What the test rewrites, and why (each is logged when it runs):
//
//   - Images: the locally built ones (the rendered tag is a placeholder).
//   - Service addresses: Kafka's brokers, NATS's URL, and the database
//     URLs' host, port, database and sslmode (each role and its password as
//     rendered: the test creates the roles and binds them as
//     docs/production/postgres.md says). Kafka's TLS and SASL settings and
//     NATS's .creds are removed: the local services have none (tested
//     against real ones by TestWorkerOverSASLSSL and
//     TestWorkerWithNATSCredsAndTLSProcessesAndIsRefusedWithout). KFN_NATS_REPLICAS 3 stays: NATS here is a
//     3-node cluster.
//   - Deployments: played as one Pod per replica, named like a
//     ReplicaSet's, each with a metrics port of its own (the host network
//     is one port space) given as KFN_METRICS_ADDR in the pod's env (moved
//     out of the ConfigMaps: podman 4.3.1 lets envFrom override env); orders
//     gets 3 replicas, as KEDA would under lag. The containers' ports list
//     is not played (podman 4.3.1 publishes a containerPort as a hostPort,
//     which --network host refuses); the probes' named port resolves to
//     the pod's metrics port. The pods' restartPolicy Always becomes
//     OnFailure: podman 4.3.1 applies the pod's policy to its init
//     containers, so under Always the migrate init container re-runs each
//     time it exits (about twice a second, for good), kube play waits 20 s
//     per pod on it, and its removal once it ran races its restart and
//     fails the play. OnFailure restarts a failed container as Always
//     does; one that exits 0 (here, only after a stop) stays down.
//   - Secrets: made with `podman secret create`, not played (podman 4.3.1
//     stores a played Secret base64-encoded, and a secret volume's files
//     would hold the base64 text; it also ignores items' paths, so each
//     file is named after its key, which for the database URLs is the
//     rendered path). Secret volumes get `optional: false` made explicit
//     (podman 4.3.1 dereferences the unset field and panics). Secrets,
//     their volumes and the pods carry the run's id in their names.
//
// Everything else is played as rendered: the probes, the env and
// ConfigMaps, the securityContext, the grace period, the resources, the
// init containers (each pod migrates, as the migrator), the workers
// under their own roles with KFN_SKIP_SETUP and KFN_NO_RELAY, and the
// relay Deployment.
func TestTheExampleOverlayRunsUnderPodmanKubePlay(t *testing.T) {
	begin := time.Now()
	run := runID(t)
	pm := newPodman(t, run)
	pg := kfntest.PostgresEmpty(t)
	kafka := kfntest.Kafka(t)
	kafka.CreateTopicNamed(t, orders.Topic, partitions)
	natsServers := kfntest.NATSClusterProcesses(t, 3)

	images := map[string]string{}
	for _, b := range []struct{ repo, pkg, name string }{
		{"ghcr.io/kfn-dev/kfn", "cmd/kfn", "kfn-kubeplay-kfn"},
		{"ghcr.io/kfn-dev/kfn-orders", "functions/orders/cmd/orders", "kfn-kubeplay-orders"},
		{"ghcr.io/kfn-dev/kfn-ledger", "functions/ledger/cmd/ledger", "kfn-kubeplay-ledger"},
	} {
		images[b.repo] = pm.buildImage(b.pkg, b.name)
	}
	t.Logf("%s in: built %d images, the services are up", time.Since(begin).Round(time.Millisecond), len(images))

	p := rewrite(t, render(t), here{
		run: run, images: images,
		kafkaBrokers: strings.Join(kafka.Brokers, ","),
		natsURL:      kfntest.JoinURLs(natsServers),
		pgHostPort:   pgHostPort(t, pg),
		database:     pg.Database,
		replicas:     map[string]int32{"orders": ordersReplicas},
		freePort:     freePort,
	})
	t.Logf("the rendered overlay, rewritten to run here:\n  %s", strings.Join(p.changes, "\n  "))
	prepareDatabase(t, pm, pg, p, images)
	for _, name := range slices.Sorted(maps.Keys(p.secrets)) {
		pm.createSecret(name, p.secrets[name])
	}
	var podNames, containers []string
	for _, pd := range p.pods {
		podNames = append(podNames, pd.name)
		for _, c := range append(slices.Clone(pd.spec.InitContainers), pd.spec.Containers...) {
			containers = append(containers, pd.container(c.Name))
		}
	}
	pm.willRun(podNames, containers)

	// Play, and probe every pod as the kubelet would.
	playStart := time.Now()
	probers, playTook := play(t, pm, p)
	t.Logf("podman kube play --network host: %d pods in %s (each pod's init container migrates before its container starts)", len(p.pods), playTook.Round(time.Millisecond))
	t.Logf("what podman made of the probes of %s: health check %s (readinessProbe and startupProbe: nothing)",
		p.pods[0].container("kfn"), pm.Inspect(p.pods[0].container("kfn"), "{{json .Config.Healthcheck}}"))
	kfntest.Await(t, readyLimit, "every pod ready by its readiness probe", func() (bool, string) {
		for _, pd := range p.pods {
			s := probers[pd.name].state()
			if len(s.restarts) > 0 {
				t.Fatalf("%s: the kubelet would have restarted it: %v\n%s", pd.name, s.restarts, pm.Logs(pd.container("kfn"), 30))
			}
			if !s.ready {
				return false, fmt.Sprintf("%s not ready (startup probe passed: %v; probes run %v, failed %v, last failures %v)", pd.name, !s.startedUp.IsZero(), s.runs, s.failures, s.lastError)
			}
		}
		return true, ""
	})
	var readiness []string
	var allReady, fromStart time.Duration
	for _, pd := range p.pods {
		pr := probers[pd.name]
		s := pr.state()
		allReady = max(allReady, s.readyAt.Sub(playStart))
		fromStart = max(fromStart, s.readyAt.Sub(pr.started))
		readiness = append(readiness, fmt.Sprintf("%-18s kfn started %4.1fs, startup probe passed %4.1fs, /readyz first 200 %4.1fs, ready by its readiness probe (every %ds) %4.1fs",
			pd.name, secs(pr.started.Sub(playStart)), secs(s.startedUp.Sub(playStart)), secs(s.firstOK.Sub(playStart)),
			orDefault(pr.container.ReadinessProbe.PeriodSeconds, 10), secs(s.readyAt.Sub(playStart))))
	}
	t.Logf("readiness, in seconds after kube play began:\n  %s", strings.Join(readiness, "\n  "))

	// Load.
	var ordersPods []pod
	for _, pd := range p.pods {
		if pd.deployment == "orders" {
			ordersPods = append(ordersPods, pd)
		}
	}
	names := func(ps []pod) []string {
		var ns []string
		for _, pd := range ps {
			ns = append(ns, pd.name)
		}
		return ns
	}
	load := produce(t, pm, images["ghcr.io/kfn-dev/kfn"], strings.Join(kafka.Brokers, ","), produced, rate)
	produceStart := time.Now()
	waitOwners(t, pg, orders.Topic, partitions, names(ordersPods), time.Minute)
	t.Logf("%s into production: %d orders pods own the partitions, balanced", time.Since(produceStart).Round(time.Millisecond), len(ordersPods))

	// A forced deletion: no grace, the leases expire.
	deleted, stopped, last := ordersPods[0], ordersPods[1], ordersPods[2]
	owned := ownedBy(cursors(t, pg, "orders", orders.Topic), deleted.name)
	if len(owned) == 0 {
		t.Fatalf("%s owns no partition", deleted.name)
	}
	deletedAt := time.Now()
	pm.Run("pod", "rm", "-f", "-t", "0", deleted.name)
	probers[deleted.name].close()
	taken := handovers(t, pg, orders.Topic, owned, names(ordersPods[1:]), p.leaseTTL+time.Minute,
		"the other orders pods to claim and commit on each partition of "+deleted.name)
	var takeover, firstCommit time.Duration
	for _, h := range taken {
		takeover = max(takeover, h.claimedAt.Sub(deletedAt))
		firstCommit = max(firstCommit, h.firstNew.Sub(deletedAt))
	}
	bound := p.leaseTTL + 2*time.Second
	forced := fmt.Sprintf("forced deletion (podman pod rm -f -t 0 %s, no grace, under load): the other pods claimed its %d partitions %.2fs after podman pod rm was called (%.2f × the lease TTL %s; bound TTL + 2s = %s), and committed on each by %.2fs",
		deleted.name, len(taken), secs(takeover), takeover.Seconds()/p.leaseTTL.Seconds(), p.leaseTTL, bound, secs(firstCommit))
	t.Log(forced)
	if takeover > bound {
		t.Errorf("the partitions of %s were claimed %s after its deletion, over TTL + 2s = %s", deleted.name, takeover, bound)
	}
	waitOwners(t, pg, orders.Topic, partitions, names(ordersPods[1:]), time.Minute)

	// A graceful stop, under load.
	select {
	case <-load.done:
		t.Fatalf("kfn produce finished before the graceful stop: the stop was not under load (raise produced)")
	default:
	}
	owned = ownedBy(cursors(t, pg, "orders", orders.Topic), stopped.name)
	if len(owned) == 0 {
		t.Fatalf("%s owns no partition", stopped.name)
	}
	grace := stopped.gracePeriod()
	stopCalled := time.Now()
	stopDone := make(chan []byte, 1)
	go func() {
		out, _ := pm.Command("pod", "stop", "-t", strconv.Itoa(int(grace/time.Second)), stopped.name).CombinedOutput()
		stopDone <- out
	}()
	handed := handovers(t, pg, orders.Topic, owned, []string{last.name}, p.leaseTTL+time.Minute,
		last.name+" to claim and commit on each partition of "+stopped.name)
	var out []byte
	select {
	case out = <-stopDone:
	case <-time.After(grace + 10*time.Second):
		t.Fatalf("podman pod stop -t %d %s did not return", int(grace/time.Second), stopped.name)
	}
	stopTook := time.Since(stopCalled)
	probers[stopped.name].close()
	if code := pm.ExitCode(stopped.container("kfn")); code != 0 {
		t.Errorf("%s exited with code %d after podman pod stop (SIGTERM, SIGKILL after %s), want 0: %s\n%s", stopped.name, code, grace, out, pm.Logs(stopped.container("kfn"), 30))
	}
	signalled := pm.SignalledAt(stopped.container("kfn"))
	exited := pm.Time(stopped.container("kfn"), "FinishedAt").Sub(signalled)
	var handoff time.Duration
	var stalls, before, claims, after []time.Duration
	contiguous := 0
	for _, h := range handed {
		handoff = max(handoff, h.claimedAt.Sub(signalled))
		stalls = append(stalls, h.firstNew.Sub(h.lastOld))
		before = append(before, signalled.Sub(h.lastOld))
		claims = append(claims, h.claimedAt.Sub(signalled))
		after = append(after, h.firstNew.Sub(h.claimedAt))
		if h.firstOffsetNew == h.lastOffsetOld+1 {
			contiguous++
		} else {
			t.Errorf("partition %d: the new term's first offset is %d, the earlier terms' last %d: not contiguous", h.partition, h.firstOffsetNew, h.lastOffsetOld)
		}
	}
	graceful := fmt.Sprintf("graceful stop (podman pod stop -t %d %s, the rendered grace period, under load): it exited 0 %.2fs after the SIGTERM reached it (podman pod stop returned after %.2fs); %s claimed its %d partitions %.2fs after the SIGTERM; handoff stall (no batch on a partition) max %.2fs, median %.2fs = last batch before the SIGTERM %.2fs + SIGTERM to claim %.2fs + claim to first batch %.2fs (medians); offsets contiguous across the handoff on %d of %d partitions",
		int(grace/time.Second), stopped.name, secs(exited), secs(stopTook), last.name, len(handed), secs(handoff), secs(slices.Max(stalls)), secs(median(stalls)),
		secs(median(before)), secs(median(claims)), secs(median(after)), contiguous, len(handed))
	t.Log(graceful)
	if handoff >= p.leaseTTL {
		t.Errorf("the partitions of %s were claimed %s after its SIGTERM: not released, left to expire (TTL %s)", stopped.name, handoff, p.leaseTTL)
	}

	// Everything produced is applied once, down the chain.
	select {
	case err := <-load.done:
		if err != nil {
			t.Fatalf("kfn produce: %v\n%s", err, load.output())
		}
	case <-time.After(2 * time.Minute):
		t.Fatalf("kfn produce did not finish:\n%s", load.output())
	}
	var onTopic int64
	for _, end := range kafka.HighWatermarks(t, orders.Topic) {
		onTopic += end
	}
	if onTopic != produced {
		t.Fatalf("the orders topic holds %d records, want the %d produced", onTopic, produced)
	}
	applied := appliedOnce(t, pg, produced, 2*time.Minute)
	t.Log(applied)

	// The pods left were ready all along, and no probe would have made
	// the kubelet restart any pod.
	notReady := 0
	for _, pd := range p.pods {
		s := probers[pd.name].state()
		if len(s.restarts) > 0 {
			t.Errorf("%s: the kubelet would have restarted it: %v", pd.name, s.restarts)
		}
		if pd.name != deleted.name && pd.name != stopped.name && (!s.ready || len(s.unready) > 0) {
			notReady++
			t.Errorf("%s went not ready (at %v; ready now: %v; probes run %v, failed %v)", pd.name, s.unready, s.ready, s.runs, s.failures)
		}
	}
	runs, failures, restarts := map[string]int{}, map[string]int{}, 0
	for _, pr := range probers {
		s := pr.state()
		for k, n := range s.runs {
			runs[k] += n
		}
		for k, n := range s.failures {
			failures[k] += n
		}
		restarts += len(s.restarts)
	}
	var probes []string
	for _, k := range []string{"startup", "readiness", "liveness"} {
		probes = append(probes, fmt.Sprintf("%s %d (%d failed)", k, runs[k], failures[k]))
	}

	version := pm.Run("version", "--format", "{{.Client.Version}}")
	fmt.Printf("\n=== kube play figures: deploy/kubernetes/overlays/example under podman %s kube play --network host (runc), %d pods (%s), lease TTL %s\n",
		version, len(p.pods), podCounts(p.pods), p.leaseTTL)
	fmt.Printf("time to ready: every pod ready by its readiness probe %.1fs after kube play began (kube play returned after %.1fs), at most %.1fs after its container started\n",
		secs(allReady), secs(playTook), secs(fromStart))
	for _, r := range readiness {
		fmt.Println("  " + r)
	}
	fmt.Println(forced)
	fmt.Println(graceful)
	fmt.Println(applied)
	fmt.Printf("probes run as the kubelet would: %s; restarts the kubelet would have made: %d; pods that went not ready (the deleted and the stopped one aside): %d\n\n", strings.Join(probes, ", "), restarts, notReady)
}

// runID is a short random id for the names this run makes.
func runID(t *testing.T) string {
	b := make([]byte, 2)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// freePort is a port nothing listens on at the moment on 127.0.0.1.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func pgHostPort(t *testing.T, pg *kfntest.PG) string {
	t.Helper()
	cfg := pg.Pool.Config().ConnConfig
	return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))
}

func podCounts(ps []pod) string {
	var order []string
	n := map[string]int{}
	for _, p := range ps {
		if n[p.deployment] == 0 {
			order = append(order, p.deployment)
		}
		n[p.deployment]++
	}
	var parts []string
	for _, d := range order {
		parts = append(parts, fmt.Sprintf("%s ×%d", d, n[d]))
	}
	return strings.Join(parts, ", ")
}

func secs(d time.Duration) float64 { return d.Seconds() }

// median is the middle of ds (the upper one of an even count).
func median(ds []time.Duration) time.Duration {
	s := slices.Sorted(slices.Values(ds))
	return s[len(s)/2]
}

// producer is kfn produce running in the kfn image.
type producer struct {
	done <-chan error
	out  *bytes.Buffer
}

func (p producer) output() string { return p.out.String() }

// produce starts kfn produce (the kfn image, host network) sending n
// orders, order i keyed by its id, at rate a second to the orders topic.
func produce(t *testing.T, pm *podman, image, brokers string, n, rate int) producer {
	t.Helper()
	var lines bytes.Buffer
	for i := range n {
		o := orders.Order{ID: fmt.Sprintf("o-%d", i), Customer: fmt.Sprintf("c-%d", i%97), AmountCents: int64(100 + i), Currency: "EUR"}
		v, err := json.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&lines, "{\"key\": %q, \"value\": %s}\n", o.ID, v)
	}
	name := "kfn-kubeplay-" + pm.run + "-produce"
	pm.willRun(nil, []string{name})
	cmd := exec.Command("podman", pm.Args("run", "--rm", "-i", "--name", name, "--network", "host", "-e", "KFN_KAFKA_BROKERS="+brokers,
		image, "produce", orders.Topic, "--file", "-", "--rate", strconv.Itoa(rate))...)
	cmd.Stdin = &lines
	out := &bytes.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatalf("podman run %s produce: %v", image, err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	return producer{done: done, out: out}
}

// appliedOnce waits until every record of the orders topic is handled and
// the ledger has booked every order, then requires each order applied
// once: one orders row with one revision, one inbox row per record, no
// dead letter; one event inbox row per order and two ledger entries each;
// no outbox row left unrelayed. It returns the counts as a sentence.
func appliedOnce(t *testing.T, pg *kfntest.PG, n int, limit time.Duration) string {
	t.Helper()
	kfntest.Await(t, limit, "every order applied by orders and booked by the ledger, the outbox drained", func() (bool, string) {
		inbox := count(t, pg, `SELECT count(*) FROM kfn.inbox i JOIN kfn.lanes l ON l.id = i.lane WHERE l.consumer = 'orders' AND l.topic = $1`, orders.Topic)
		events := count(t, pg, `SELECT count(*) FROM kfn.event_inbox WHERE consumer = 'ledger'`)
		outbox := count(t, pg, `SELECT count(*) FROM kfn.outbox`)
		return inbox >= int64(n) && events >= int64(n) && outbox == 0,
			fmt.Sprintf("orders inbox %d, ledger event inbox %d of %d; outbox rows %d", inbox, events, n, outbox)
	})
	rows := count(t, pg, `SELECT count(*) FROM orders`)
	revisions := count(t, pg, `SELECT coalesce(sum(revisions), 0) FROM orders`)
	inbox := count(t, pg, `SELECT count(*) FROM kfn.inbox i JOIN kfn.lanes l ON l.id = i.lane WHERE l.consumer = 'orders' AND l.topic = $1`, orders.Topic)
	dead := count(t, pg, `SELECT count(*) FROM kfn.dead_letters`)
	events := count(t, pg, `SELECT count(*) FROM kfn.event_inbox WHERE consumer = 'ledger'`)
	entries := count(t, pg, `SELECT count(*) FROM ledger_entries`)
	booked := count(t, pg, `SELECT count(DISTINCT order_id) FROM ledger_entries`)
	outbox := count(t, pg, `SELECT count(*) FROM kfn.outbox`)
	lost, duplicated := int64(n)-rows, revisions-rows
	if lost != 0 || duplicated != 0 || inbox != int64(n) || dead != 0 || events != int64(n) || entries != 2*int64(n) || booked != int64(n) || outbox != 0 {
		t.Errorf("exactly-once violated: orders lost %d, duplicated %d, inbox rows %d of %d, dead letters %d; ledger events %d, entries %d (want %d) for %d orders; outbox rows %d",
			lost, duplicated, inbox, n, dead, events, entries, 2*n, booked, outbox)
	}
	return fmt.Sprintf("records: %d orders produced (kfn produce, %d/s; the topic holds as many); orders rows %d (lost %d), applies %d (duplicated %d), inbox rows %d, dead letters %d; ledger: %d orders.accepted events applied (event inbox), %d entries for %d orders; outbox rows left %d",
		n, rate, rows, lost, revisions, duplicated, inbox, dead, events, entries, booked, outbox)
}
