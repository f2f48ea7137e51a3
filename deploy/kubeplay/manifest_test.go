//go:build container

package kubeplay

import (
	"bytes"
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/kfn-dev/kfn/runtime"
)

// overlay is the example the test plays, as users apply it.
const overlay = "../kubernetes/overlays/example"

// here is what the rendered overlay is rewritten to on this machine.
type here struct {
	run          string            // a short id in every name this run makes (pods, secrets, volumes)
	images       map[string]string // rendered image repository (no tag) → a local image this run built
	kafkaBrokers string            // host:port on the host network
	natsURL      string            // nats://…, comma-separated
	pgHostPort   string            // host:port of the local Postgres
	database     string            // its database for this run
	replicas     map[string]int32  // Deployments whose replicas another controller owns (KEDA)
	freePort     func() (int, error)
}

// played is the overlay as podman plays it here.
type played struct {
	common  [][]byte                     // ConfigMaps and the kinds podman skips
	pods    []pod                        // in the order of the Deployments and their replicas
	secrets map[string]map[string]string // podman secret name → key → value
	changes []string                     // each rewrite, with its reason
	// leaseTTL is the workers' (their ConfigMap's, else kfn's default).
	leaseTTL time.Duration
}

// pod is one replica of a rendered Deployment.
type pod struct {
	name       string // also the worker id (KFN_WORKER_ID from metadata.name)
	deployment string
	// spec is the pod's spec as played, but with the container ports kept
	// (the metrics port moved to this pod's own), which the probes name.
	spec corev1.PodSpec
	doc  []byte // the Pod as podman plays it
}

// container is the name podman gives container c of the pod.
func (p pod) container(c string) string { return p.name + "-" + c }

// gracePeriod is the pod's rendered terminationGracePeriodSeconds
// (Kubernetes' default 30 s when unset).
func (p pod) gracePeriod() time.Duration {
	if g := p.spec.TerminationGracePeriodSeconds; g != nil {
		return time.Duration(*g) * time.Second
	}
	return 30 * time.Second
}

// yaml is what podman plays: the rendered output's ConfigMaps and other
// kinds, and the pods.
func (p played) yaml() []byte {
	docs := slices.Clone(p.common)
	for _, pd := range p.pods {
		docs = append(docs, pd.doc)
	}
	return bytes.Join(docs, []byte("---\n"))
}

// render builds the overlay in process (krusty, from the disk, offline).
func render(t *testing.T) [][]byte {
	t.Helper()
	rm, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), overlay)
	if err != nil {
		t.Fatalf("kustomize build %s: %v", overlay, err)
	}
	var docs [][]byte
	for _, res := range rm.Resources() {
		data, err := res.AsYAML()
		if err != nil {
			t.Fatalf("%s: %v", res.CurId(), err)
		}
		docs = append(docs, data)
	}
	return docs
}

// Settings that name what the test's services do not have: Kafka here is
// plaintext without SASL, NATS has no accounts (.creds). The workers'
// TLS and SASL to Kafka, and .creds over TLS to NATS, are tested against
// real servers elsewhere (TestWorkerOverSASLSSL,
// TestWorkerWithNATSCredsAndTLSProcessesAndIsRefusedWithout).
var (
	securitySettings = []string{"KFN_KAFKA_TLS", "KFN_KAFKA_SASL_MECHANISM", "KFN_KAFKA_SASL_PASSWORD_FILE", "KFN_KAFKA_CA", "KFN_NATS_CREDS"}
	securityEnv      = []string{"KFN_KAFKA_SASL_USER"}
)

// rewrite turns the rendered overlay into what runs here. Each change is
// recorded in played.changes with its reason; everything else (the
// probes, the env, the securityContext, the grace period, the resources,
// the init containers and their args) is played as rendered.
func rewrite(t *testing.T, docs [][]byte, h here) played {
	t.Helper()
	p := played{secrets: map[string]map[string]string{}}
	change := func(format string, args ...any) { p.changes = append(p.changes, fmt.Sprintf(format, args...)) }
	p.leaseTTL = runtime.Config{}.WithDefaults().LeaseTTL
	secretNames := map[string]string{} // rendered → podman's
	var deployments []appsv1.Deployment
	for _, doc := range docs {
		var meta struct {
			Kind string `json:"kind"`
		}
		if err := yaml.Unmarshal(doc, &meta); err != nil {
			t.Fatalf("rendered object: %v", err)
		}
		switch meta.Kind {
		case "Secret":
			var s corev1.Secret
			mustDecode(t, doc, &s)
			name := s.Name + "-" + h.run
			secretNames[s.Name] = name
			values := map[string]string{}
			for k, v := range s.Data {
				values[k] = string(v)
			}
			for k, v := range s.StringData {
				values[k] = v
			}
			for _, k := range slices.Sorted(maps.Keys(values)) {
				v := values[k]
				if u, err := url.Parse(v); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
					q := u.Query()
					q.Set("sslmode", "disable")
					u.Host, u.Path, u.RawQuery = h.pgHostPort, "/"+h.database, q.Encode()
					values[k] = u.String()
					change("Secret %s, %s: the local Postgres, database %s, sslmode=disable (the role %s and its password as rendered)", s.Name, k, h.database, u.User.Username())
				}
			}
			p.secrets[name] = values
		case "ConfigMap":
			var cm corev1.ConfigMap
			mustDecode(t, doc, &cm)
			for _, k := range slices.Sorted(maps.Keys(cm.Data)) {
				v := cm.Data[k]
				switch {
				case k == "KFN_KAFKA_BROKERS":
					cm.Data[k] = h.kafkaBrokers
					change("ConfigMap %s, %s: %s → %s (the test's Kafka, on the host network)", cm.Name, k, v, h.kafkaBrokers)
				case k == "KFN_NATS_URL":
					cm.Data[k] = h.natsURL
					change("ConfigMap %s, %s: %s → %s (the test's 3-node NATS cluster)", cm.Name, k, v, h.natsURL)
				case slices.Contains(securitySettings, k):
					delete(cm.Data, k)
					change("ConfigMap %s, %s=%s: removed (the local Kafka and NATS run without TLS, SASL or accounts)", cm.Name, k, v)
				case k == "KFN_METRICS_ADDR":
					delete(cm.Data, k)
					change("ConfigMap %s, %s=%s: moved to each pod's env with a port of its own (the host network is one port space, and podman 4.3.1 lets envFrom override env)", cm.Name, k, v)
				case k == "KFN_LEASE_TTL":
					d, err := time.ParseDuration(v)
					if err != nil {
						t.Fatalf("ConfigMap %s, %s=%q: %v", cm.Name, k, v, err)
					}
					p.leaseTTL = d
				}
			}
			p.common = append(p.common, mustEncode(t, cm))
		case "Deployment":
			var d appsv1.Deployment
			mustDecode(t, doc, &d)
			deployments = append(deployments, d)
		default:
			// Namespace, Service, PodDisruptionBudget, ScaledObject,
			// TriggerAuthentication, PodMonitor, PrometheusRule: played
			// as rendered; podman 4.3 skips kinds it does not support.
			p.common = append(p.common, doc)
		}
	}
	change("Secrets: created with `podman secret create`, not played, named with the run's id %q (podman 4.3.1 stores a played Secret base64-encoded, so a secret volume's files would hold base64; podman's secrets are global)", h.run)
	for _, d := range deployments {
		replicas := int32(1)
		if d.Spec.Replicas != nil {
			replicas = *d.Spec.Replicas
		}
		if r, ok := h.replicas[d.Name]; ok {
			change("Deployment %s: %d replicas, as KEDA would scale it under lag (rendered without replicas: KEDA owns them)", d.Name, r)
			replicas = r
		}
		change("Deployment %s: played as %d Pods %s-%s-0…, one per replica, as its ReplicaSet would make them (each needs a metrics port of its own)", d.Name, replicas, d.Name, h.run)
		for i := range replicas {
			p.pods = append(p.pods, replica(t, d, int(i), h, secretNames, change))
		}
	}
	return p
}

// replica makes pod i of Deployment d: the pod as the prober sees it, and
// the rewritten Pod podman plays.
func replica(t *testing.T, d appsv1.Deployment, i int, h here, secretNames map[string]string, change func(string, ...any)) pod {
	t.Helper()
	first := i == 0 // each change is said once per Deployment
	say := func(format string, args ...any) {
		if first {
			change(format, args...)
		}
	}
	port, err := h.freePort()
	if err != nil {
		t.Fatal(err)
	}
	spec := *d.Spec.Template.Spec.DeepCopy()
	meta := *d.Spec.Template.ObjectMeta.DeepCopy()
	meta.Name = fmt.Sprintf("%s-%s-%d", d.Name, h.run, i)
	meta.Namespace = d.Namespace
	if _, ok := meta.Annotations["prometheus.io/port"]; ok {
		meta.Annotations["prometheus.io/port"] = strconv.Itoa(port)
	}
	for _, cs := range [][]corev1.Container{spec.InitContainers, spec.Containers} {
		for j := range cs {
			c := &cs[j]
			repo, tag := splitImage(c.Image)
			local, ok := h.images[repo]
			if !ok {
				t.Fatalf("Deployment %s, container %s: image %s is not one this test builds", d.Name, c.Name, c.Image)
			}
			say("Deployment %s, container %s: image %s → %s (built here FROM scratch by deploy/image.sh; the rendered tag %s is a placeholder)", d.Name, c.Name, c.Image, local, tag)
			c.Image = local
			c.Env = slices.DeleteFunc(c.Env, func(e corev1.EnvVar) bool {
				if slices.Contains(securityEnv, e.Name) {
					say("Deployment %s, container %s: env %s removed (Kafka here has no SASL)", d.Name, c.Name, e.Name)
					return true
				}
				return false
			})
			for k := range c.Ports {
				if c.Ports[k].Name == "metrics" {
					say("Deployment %s, container %s: port metrics %d → a free port per pod, set as KFN_METRICS_ADDR in the pod's env; the ports list is not played (podman 4.3.1 publishes a containerPort as a hostPort, which --network host refuses); the probes' named port resolves to it", d.Name, c.Name, c.Ports[k].ContainerPort)
					c.Ports[k].ContainerPort = int32(port)
					c.Env = append(c.Env, corev1.EnvVar{Name: "KFN_METRICS_ADDR", Value: ":" + strconv.Itoa(port)})
				}
			}
		}
	}
	for k := range spec.Volumes {
		v := &spec.Volumes[k]
		if v.Secret == nil {
			continue
		}
		name, ok := secretNames[v.Secret.SecretName]
		if !ok {
			t.Fatalf("Deployment %s, volume %s: Secret %s is not rendered", d.Name, v.Name, v.Secret.SecretName)
		}
		v.Secret.SecretName = name
		if v.Secret.Optional == nil {
			v.Secret.Optional = new(false)
			say("Deployment %s, volume %s: optional: false made explicit (podman 4.3.1 dereferences it; false is Kubernetes' default)", d.Name, v.Name)
		}
	}
	if spec.RestartPolicy == "" || spec.RestartPolicy == corev1.RestartPolicyAlways {
		say("Deployment %s: the pods' restartPolicy Always → OnFailure (podman 4.3.1 gives the pod's policy to its init containers too: under Always the migrate init container re-runs each time it exits, about twice a second, and kube play waits 20 s per pod on it; OnFailure restarts a failed container as Always does, and the init container runs once)", d.Name)
		spec.RestartPolicy = corev1.RestartPolicyOnFailure
	}
	pd := pod{name: meta.Name, deployment: d.Name, spec: spec}
	// What podman plays: the same, without the ports.
	playedSpec := *spec.DeepCopy()
	for j := range playedSpec.Containers {
		playedSpec.Containers[j].Ports = nil
	}
	for j := range playedSpec.InitContainers {
		playedSpec.InitContainers[j].Ports = nil
	}
	pd.doc = mustEncode(t, corev1.Pod{TypeMeta: typeMeta("v1", "Pod"), ObjectMeta: meta, Spec: playedSpec})
	return pd
}

// splitImage splits an image reference into its repository and its tag
// (or digest).
func splitImage(ref string) (repo, tag string) {
	if i := strings.LastIndexAny(ref, ":@"); i > strings.LastIndex(ref, "/") {
		return ref[:i], ref[i+1:]
	}
	return ref, ""
}

func typeMeta(apiVersion, kind string) metav1.TypeMeta {
	return metav1.TypeMeta{APIVersion: apiVersion, Kind: kind}
}

func mustDecode(t *testing.T, doc []byte, into any) {
	t.Helper()
	if err := yaml.UnmarshalStrict(doc, into); err != nil {
		t.Fatalf("decode rendered object: %v\n%s", err, doc)
	}
}

func mustEncode(t *testing.T, obj any) []byte {
	t.Helper()
	data, err := yaml.Marshal(obj)
	if err != nil {
		t.Fatal(err)
	}
	return data
}
