package deploy

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

const overlay = "kubernetes/overlays/example"

// Local, strict shapes of the custom resources the manifests use (KEDA's
// and the Prometheus Operator's), holding only the fields kfn sets: an
// unknown or misspelt field fails the strict decoding.
type (
	objectMeta struct {
		Name      string            `json:"name"`
		Namespace string            `json:"namespace"`
		Labels    map[string]string `json:"labels"`
	}
	scaledObject struct {
		APIVersion string     `json:"apiVersion"`
		Kind       string     `json:"kind"`
		Metadata   objectMeta `json:"metadata"`
		Spec       struct {
			ScaleTargetRef struct {
				Name string `json:"name"`
			} `json:"scaleTargetRef"`
			MinReplicaCount *int `json:"minReplicaCount"`
			MaxReplicaCount *int `json:"maxReplicaCount"`
			PollingInterval int  `json:"pollingInterval"`
			CooldownPeriod  int  `json:"cooldownPeriod"`
			Triggers        []struct {
				Type              string `json:"type"`
				AuthenticationRef struct {
					Name string `json:"name"`
				} `json:"authenticationRef"`
				Metadata kafkaTrigger `json:"metadata"`
			} `json:"triggers"`
		} `json:"spec"`
	}
	// kafkaTrigger is the metadata of KEDA's kafka scaler (values are strings).
	kafkaTrigger struct {
		BootstrapServers       string `json:"bootstrapServers"`
		ConsumerGroup          string `json:"consumerGroup"`
		Topic                  string `json:"topic"`
		LagThreshold           string `json:"lagThreshold"`
		ActivationLagThreshold string `json:"activationLagThreshold"`
		OffsetResetPolicy      string `json:"offsetResetPolicy"`
		ExcludePersistentLag   string `json:"excludePersistentLag"`
		AllowIdleConsumers     string `json:"allowIdleConsumers"`
	}
	triggerAuthentication struct {
		APIVersion string     `json:"apiVersion"`
		Kind       string     `json:"kind"`
		Metadata   objectMeta `json:"metadata"`
		Spec       struct {
			SecretTargetRef []struct {
				Parameter string `json:"parameter"`
				Name      string `json:"name"`
				Key       string `json:"key"`
			} `json:"secretTargetRef"`
		} `json:"spec"`
	}
	// podMonitor is the Prometheus Operator's PodMonitor
	// (monitoring.coreos.com/v1), the fields kfn sets.
	podMonitor struct {
		APIVersion string     `json:"apiVersion"`
		Kind       string     `json:"kind"`
		Metadata   objectMeta `json:"metadata"`
		Spec       struct {
			Selector struct {
				MatchLabels map[string]string `json:"matchLabels"`
			} `json:"selector"`
			PodTargetLabels     []string `json:"podTargetLabels"`
			PodMetricsEndpoints []struct {
				Port     string `json:"port"`
				Path     string `json:"path"`
				Interval string `json:"interval"`
			} `json:"podMetricsEndpoints"`
		} `json:"spec"`
	}
	prometheusRule struct {
		APIVersion string     `json:"apiVersion"`
		Kind       string     `json:"kind"`
		Metadata   objectMeta `json:"metadata"`
		Spec       struct {
			Groups []struct {
				Name  string `json:"name"`
				Rules []struct {
					Alert       string            `json:"alert"`
					Expr        string            `json:"expr"`
					For         string            `json:"for"`
					Labels      map[string]string `json:"labels"`
					Annotations map[string]string `json:"annotations"`
				} `json:"rules"`
			} `json:"groups"`
		} `json:"spec"`
	}
)

// rendered is the overlay's objects, each decoded strictly into its type.
type rendered struct {
	deployments  []appsv1.Deployment
	configMaps   map[string]corev1.ConfigMap
	secrets      map[string]corev1.Secret
	pdbs         []policyv1.PodDisruptionBudget
	namespaces   []corev1.Namespace
	scaled       []scaledObject
	triggerAuths map[string]triggerAuthentication
	rules        []prometheusRule
	services     []corev1.Service
	podMonitors  []podMonitor
}

// render builds the overlay in process (krusty, from the disk, offline) and
// decodes every object with unknown fields refused.
func render(t *testing.T, path string) rendered {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	rm, err := k.Run(filesys.MakeFsOnDisk(), path)
	if err != nil {
		t.Fatalf("kustomize build %s: %v", path, err)
	}
	r := rendered{configMaps: map[string]corev1.ConfigMap{}, secrets: map[string]corev1.Secret{}, triggerAuths: map[string]triggerAuthentication{}}
	for _, res := range rm.Resources() {
		data, err := res.AsYAML()
		if err != nil {
			t.Fatalf("%s: %v", res.CurId(), err)
		}
		kind := res.GetKind()
		strict := func(into any) {
			if err := yaml.UnmarshalStrict(data, into); err != nil {
				t.Errorf("%s %s: %v", kind, res.GetName(), err)
			}
		}
		switch kind {
		case "Deployment":
			r.deployments = append(r.deployments, decode[appsv1.Deployment](strict))
		case "ConfigMap":
			c := decode[corev1.ConfigMap](strict)
			r.configMaps[c.Name] = c
		case "Secret":
			sec := decode[corev1.Secret](strict)
			r.secrets[sec.Name] = sec
		case "PodDisruptionBudget":
			r.pdbs = append(r.pdbs, decode[policyv1.PodDisruptionBudget](strict))
		case "Namespace":
			r.namespaces = append(r.namespaces, decode[corev1.Namespace](strict))
		case "ScaledObject":
			r.scaled = append(r.scaled, decode[scaledObject](strict))
		case "TriggerAuthentication":
			a := decode[triggerAuthentication](strict)
			r.triggerAuths[a.Metadata.Name] = a
		case "PrometheusRule":
			r.rules = append(r.rules, decode[prometheusRule](strict))
		case "Service":
			r.services = append(r.services, decode[corev1.Service](strict))
		case "PodMonitor":
			r.podMonitors = append(r.podMonitors, decode[podMonitor](strict))
		default:
			t.Errorf("%s %s: a kind this test does not decode: add it", kind, res.GetName())
		}
	}
	return r
}

// decode returns a T filled by strict (which reports what does not fit).
func decode[T any](strict func(into any)) T {
	var v T
	strict(&v)
	return v
}

// TestKubernetesManifestsAreValid renders the example overlay and checks
// every object against the Kubernetes API types, Pod Security "restricted",
// the kfn binaries' settings and the references between the objects.
func TestKubernetesManifestsAreValid(t *testing.T) {
	r := render(t, overlay)
	if len(r.deployments) != 3 || len(r.scaled) != 1 || len(r.rules) != 1 || len(r.pdbs) != 3 {
		t.Fatalf("rendered %d Deployments, %d ScaledObjects, %d PrometheusRules, %d PodDisruptionBudgets; want 3, 1, 1, 3",
			len(r.deployments), len(r.scaled), len(r.rules), len(r.pdbs))
	}
	users := imageUsers(t)
	for _, d := range r.deployments {
		t.Run(d.Name, func(t *testing.T) {
			checkPodSecurity(t, d, users)
			checkWorkload(t, r, d)
		})
	}
	checkDisruptionBudgets(t, r)
	checkKEDA(t, r)
	checkScraping(t, r)
	if len(r.namespaces) != 1 || r.namespaces[0].Labels["pod-security.kubernetes.io/enforce"] != "restricted" {
		t.Errorf("want one Namespace enforcing Pod Security restricted, got %+v", r.namespaces)
	}
}

// imageUsers reads the numeric user ids of the scratch image's /etc/passwd.
func imageUsers(t *testing.T) map[int64]string {
	t.Helper()
	f, err := os.Open("scratch/passwd")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	users := map[int64]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Split(sc.Text(), ":")
		if len(fields) != 7 {
			t.Fatalf("scratch/passwd: %q is not a passwd line", sc.Text())
		}
		uid, err := strconv.ParseInt(fields[2], 10, 64)
		if err != nil {
			t.Fatalf("scratch/passwd: %q: %v", sc.Text(), err)
		}
		users[uid] = fields[0]
	}
	return users
}

// checkPodSecurity checks the rules of Pod Security "restricted" (and the
// baseline rules it includes) field by field.
func checkPodSecurity(t *testing.T, d appsv1.Deployment, users map[int64]string) {
	spec := d.Spec.Template.Spec
	if spec.HostNetwork || spec.HostPID || spec.HostIPC {
		t.Errorf("host namespaces are not allowed")
	}
	psc := spec.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot {
		t.Errorf("pod securityContext.runAsNonRoot must be true")
	}
	if psc == nil || psc.RunAsUser == nil || *psc.RunAsUser == 0 {
		t.Errorf("pod securityContext.runAsUser must be a non-zero number")
	} else if users[*psc.RunAsUser] == "" {
		t.Errorf("pod runAsUser %d has no entry in the image's /etc/passwd (deploy/scratch/passwd)", *psc.RunAsUser)
	}
	if psc == nil || psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod securityContext.seccompProfile.type must be RuntimeDefault")
	}
	for _, v := range spec.Volumes {
		if v.HostPath != nil {
			t.Errorf("volume %s: hostPath is not allowed", v.Name)
		}
		if v.Secret == nil && v.ConfigMap == nil && v.EmptyDir == nil && v.Projected == nil && v.DownwardAPI == nil {
			t.Errorf("volume %s: a volume type restricted does not allow, or one this test does not know", v.Name)
		}
	}
	for _, c := range append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...) {
		sc := c.SecurityContext
		where := "container " + c.Name
		if sc == nil {
			t.Errorf("%s: no securityContext", where)
			continue
		}
		if sc.Privileged != nil && *sc.Privileged {
			t.Errorf("%s: privileged", where)
		}
		if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
			t.Errorf("%s: allowPrivilegeEscalation must be false", where)
		}
		if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
			t.Errorf("%s: readOnlyRootFilesystem must be true", where)
		}
		if sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
			t.Errorf("%s: runAsNonRoot must be true", where)
		}
		if sc.RunAsUser == nil || *sc.RunAsUser == 0 || users[*sc.RunAsUser] == "" {
			t.Errorf("%s: runAsUser must be a non-zero user of the image's /etc/passwd", where)
		}
		if sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" || len(sc.Capabilities.Add) != 0 {
			t.Errorf("%s: capabilities must drop ALL and add none", where)
		}
		if sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
			t.Errorf("%s: seccompProfile.type must be RuntimeDefault", where)
		}
		for _, p := range c.Ports {
			if p.HostPort != 0 {
				t.Errorf("%s: hostPort is not allowed", where)
			}
		}
	}
}

var pinned = regexp.MustCompile(`^[a-z0-9.-]+(/[a-z0-9._-]+)+(:v[0-9]+\.[0-9]+\.[0-9]+|@sha256:[0-9a-f]{64})$`)

// binaryOf maps a container to the binary it runs (the kfn image runs the
// command of its args, a function image its function) and returns the args
// left for that binary's flags.
func binaryOf(t *testing.T, c corev1.Container) (binary, []string) {
	repo := c.Image
	if i := strings.LastIndexAny(repo, ":@"); i > strings.LastIndex(repo, "/") {
		repo = repo[:i]
	}
	name := repo[strings.LastIndex(repo, "/")+1:]
	if name == "kfn" {
		return kfnCommand(t, c.Args)
	}
	fn, ok := strings.CutPrefix(name, "kfn-")
	if !ok {
		t.Fatalf("container %s: image %s is not a kfn image", c.Name, c.Image)
	}
	return help(t, fn), c.Args
}

// checkWorkload checks each container's image, binary settings, Secret and
// ConfigMap references, probes, resources and the pod's grace period.
func checkWorkload(t *testing.T, r rendered, d appsv1.Deployment) {
	spec := d.Spec.Template.Spec
	if len(spec.InitContainers) == 0 || spec.InitContainers[0].Args[0] != "migrate" {
		t.Errorf("the first init container must migrate (kfn migrate, or the function binary's migrate mode), so the schema is there before the process starts")
	}
	if sel, err := metav1LabelSelector(d); err != nil || !sel.Matches(labels.Set(d.Spec.Template.Labels)) {
		t.Errorf("selector does not match the pod template's labels: %v", err)
	}
	mounted := mountedSecretFiles(spec)
	for i, c := range append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...) {
		where := "container " + c.Name
		if !pinned.MatchString(c.Image) {
			t.Errorf("%s: image %q is not pinned to a version (:vX.Y.Z) or a digest", where, c.Image)
		}
		for _, res := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			if _, ok := c.Resources.Requests[res]; !ok {
				t.Errorf("%s: no %s request", where, res)
			}
			if _, ok := c.Resources.Limits[res]; !ok {
				t.Errorf("%s: no %s limit", where, res)
			}
		}
		b, args := binaryOf(t, c)
		checkArgs(t, where, b, args)
		env := map[string]string{}
		for _, e := range c.Env {
			checkEnv(t, where, b, e.Name)
			env[e.Name] = e.Value
			if ref := e.ValueFrom; ref != nil {
				if k := ref.SecretKeyRef; k != nil {
					checkKey(t, where, "Secret", k.Name, k.Key, secretKeys(r, k.Name))
				}
				if k := ref.ConfigMapKeyRef; k != nil {
					checkKey(t, where, "ConfigMap", k.Name, k.Key, r.configMaps[k.Name].Data)
				}
			}
		}
		for _, from := range c.EnvFrom {
			if from.ConfigMapRef == nil {
				t.Errorf("%s: envFrom other than a ConfigMap", where)
				continue
			}
			cm, ok := r.configMaps[from.ConfigMapRef.Name]
			if !ok {
				t.Errorf("%s: envFrom names ConfigMap %s, which is not rendered", where, from.ConfigMapRef.Name)
			}
			for k, v := range cm.Data {
				checkEnv(t, where+" (ConfigMap "+cm.Name+")", b, k)
				env[k] = v
			}
		}
		for name, path := range env {
			if strings.HasSuffix(name, "_FILE") || name == "KFN_KAFKA_CA" {
				if !mounted[fileIn(c, path)] {
					t.Errorf("%s: %s=%s is not a file of a Secret volume mounted in the container", where, name, path)
				}
			}
		}
		if i < len(spec.InitContainers) {
			continue // an init container runs to completion: no probes
		}
		checkProbes(t, where, b, c, env)
	}
	checkGracePeriod(t, r, d)
	for _, v := range spec.Volumes {
		if v.Secret != nil {
			keys := secretKeys(r, v.Secret.SecretName)
			for _, it := range v.Secret.Items {
				checkKey(t, "volume "+v.Name, "Secret", v.Secret.SecretName, it.Key, keys)
			}
		}
	}
}

func metav1LabelSelector(d appsv1.Deployment) (labels.Selector, error) {
	if d.Spec.Selector == nil {
		return nil, fmt.Errorf("no selector")
	}
	return labels.ValidatedSelectorFromSet(d.Spec.Selector.MatchLabels)
}

// mountedSecretFiles is the set of "volume/file" of the pod's Secret volumes.
func mountedSecretFiles(spec corev1.PodSpec) map[string]bool {
	files := map[string]bool{}
	for _, v := range spec.Volumes {
		if v.Secret == nil {
			continue
		}
		for _, it := range v.Secret.Items {
			files[v.Name+"/"+it.Path] = true
		}
	}
	return files
}

// fileIn returns "volume/file" for a path under one of c's mounts.
func fileIn(c corev1.Container, path string) string {
	for _, m := range c.VolumeMounts {
		if rest, ok := strings.CutPrefix(path, m.MountPath+"/"); ok {
			return m.Name + "/" + rest
		}
	}
	return ""
}

func secretKeys(r rendered, name string) map[string]string {
	s, ok := r.secrets[name]
	if !ok {
		return nil
	}
	keys := map[string]string{}
	for k, v := range s.Data {
		keys[k] = string(v)
	}
	for k, v := range s.StringData {
		keys[k] = v
	}
	return keys
}

func checkKey(t *testing.T, where, kind, name, key string, keys map[string]string) {
	t.Helper()
	if keys == nil {
		t.Errorf("%s: names %s %s, which is not rendered", where, kind, name)
	} else if _, ok := keys[key]; !ok {
		t.Errorf("%s: %s %s has no key %q", where, kind, name, key)
	}
}

// checkProbes checks liveness on /healthz and readiness on /readyz, on the
// port KFN_METRICS_ADDR serves, paths the binary says --metrics-addr serves.
func checkProbes(t *testing.T, where string, b binary, c corev1.Container, env map[string]string) {
	addr, ok := env["KFN_METRICS_ADDR"]
	if !ok {
		t.Errorf("%s: KFN_METRICS_ADDR is not set: no /healthz or /readyz to probe", where)
		return
	}
	_, portText, _ := strings.Cut(addr, ":")
	port, err := strconv.Atoi(portText)
	if err != nil {
		t.Errorf("%s: KFN_METRICS_ADDR %q has no port", where, addr)
	}
	probe := func(kind string, p *corev1.Probe, path string) {
		if p == nil || p.HTTPGet == nil {
			t.Errorf("%s: no HTTP %s probe", where, kind)
			return
		}
		if p.HTTPGet.Path != path {
			t.Errorf("%s: %s probe on %s, want %s", where, kind, p.HTTPGet.Path, path)
		}
		if !strings.Contains(b.text, p.HTTPGet.Path) {
			t.Errorf("%s: %s probe on %s, which %s -h does not say it serves", where, kind, p.HTTPGet.Path, b.name)
		}
		got := p.HTTPGet.Port.IntValue()
		for _, cp := range c.Ports {
			if cp.Name == p.HTTPGet.Port.String() {
				got = int(cp.ContainerPort)
			}
		}
		if got != port {
			t.Errorf("%s: %s probe on port %s (%d), but KFN_METRICS_ADDR serves %d", where, kind, p.HTTPGet.Port.String(), got, port)
		}
	}
	probe("liveness", c.LivenessProbe, "/healthz")
	probe("readiness", c.ReadinessProbe, "/readyz")
	probe("startup", c.StartupProbe, "/healthz")
}

// drain is what a clean stop needs after the handler timeout: 1 s to
// abandon a handler that ignores its ctx, the batch's commit, the leases'
// release and the last offset mirror flush (2 s), with room to spare.
const drain = 10 * time.Second

// checkGracePeriod checks that SIGTERM has time to end cleanly.
func checkGracePeriod(t *testing.T, r rendered, d appsv1.Deployment) {
	timeout := 30 * time.Second // KFN_HANDLER_TIMEOUT's default
	for _, c := range d.Spec.Template.Spec.Containers {
		for _, from := range c.EnvFrom {
			if from.ConfigMapRef == nil {
				continue
			}
			if v, ok := r.configMaps[from.ConfigMapRef.Name].Data["KFN_HANDLER_TIMEOUT"]; ok {
				var err error
				if timeout, err = time.ParseDuration(v); err != nil {
					t.Errorf("KFN_HANDLER_TIMEOUT %q: %v", v, err)
				}
			}
		}
	}
	g := d.Spec.Template.Spec.TerminationGracePeriodSeconds
	if g == nil || time.Duration(*g)*time.Second <= timeout+drain {
		t.Errorf("terminationGracePeriodSeconds %v must exceed the handler timeout %s + the drain %s", ptrText(g), timeout, drain)
	}
}

// checkDisruptionBudgets checks one budget per Deployment, selecting its pods.
func checkDisruptionBudgets(t *testing.T, r rendered) {
	for _, d := range r.deployments {
		n := 0
		for _, p := range r.pdbs {
			sel, err := labels.ValidatedSelectorFromSet(p.Spec.Selector.MatchLabels)
			if err == nil && sel.Matches(labels.Set(d.Spec.Template.Labels)) {
				n++
			}
		}
		if n != 1 {
			t.Errorf("Deployment %s: %d PodDisruptionBudgets select its pods, want 1", d.Name, n)
		}
	}
}

// checkKEDA checks the ScaledObject against the function it scales: its
// consumer group and topic (from --describe), its start position and its
// brokers (from the workers' settings), and its TriggerAuthentication.
func checkKEDA(t *testing.T, r rendered) {
	for _, s := range r.scaled {
		var target *appsv1.Deployment
		for i := range r.deployments {
			if r.deployments[i].Name == s.Spec.ScaleTargetRef.Name {
				target = &r.deployments[i]
			}
		}
		if target == nil {
			t.Errorf("ScaledObject %s scales %s, which is not a rendered Deployment", s.Metadata.Name, s.Spec.ScaleTargetRef.Name)
			continue
		}
		if target.Spec.Replicas != nil {
			t.Errorf("Deployment %s sets replicas, which KEDA owns", target.Name)
		}
		if s.Spec.MinReplicaCount == nil || *s.Spec.MinReplicaCount != 0 {
			t.Errorf("ScaledObject %s: minReplicaCount must be 0 (scale to zero)", s.Metadata.Name)
		}
		c := target.Spec.Template.Spec.Containers[0]
		b, _ := binaryOf(t, c)
		fn := describe(t, b.name)
		// The alert on a function absent while its topic has lag maps
		// keda_scaler_active's scaledObject label to the function's name.
		if s.Metadata.Name != fn.Name {
			t.Errorf("ScaledObject %s scales function %s: name it after the function (KfnFunctionAbsentWithLag in alerts.yaml reads its name as the function's)", s.Metadata.Name, fn.Name)
		}
		settings := map[string]string{}
		for _, from := range c.EnvFrom {
			for k, v := range r.configMaps[from.ConfigMapRef.Name].Data {
				settings[k] = v
			}
		}
		startFrom := settings["KFN_START_FROM"]
		if startFrom == "" {
			startFrom = "earliest" // the default (orders -h)
		}
		if len(s.Spec.Triggers) != 1 || s.Spec.Triggers[0].Type != "kafka" {
			t.Fatalf("ScaledObject %s: want one kafka trigger, got %+v", s.Metadata.Name, s.Spec.Triggers)
		}
		tr := s.Spec.Triggers[0]
		m := tr.Metadata
		for _, c := range []struct{ field, got, want string }{
			{"consumerGroup (kfn mirrors its cursors into the group named after the function)", m.ConsumerGroup, fn.Name},
			{"topic", m.Topic, fn.Topic},
			{"offsetResetPolicy (KFN_START_FROM)", m.OffsetResetPolicy, startFrom},
			{"bootstrapServers (KFN_KAFKA_BROKERS)", m.BootstrapServers, settings["KFN_KAFKA_BROKERS"]},
			{"excludePersistentLag", m.ExcludePersistentLag, "true"},
			{"allowIdleConsumers", m.AllowIdleConsumers, "false"},
		} {
			if c.got != c.want {
				t.Errorf("ScaledObject %s: %s is %q, want %q", s.Metadata.Name, c.field, c.got, c.want)
			}
		}
		if n, err := strconv.Atoi(m.ActivationLagThreshold); err != nil || n < 1 {
			t.Errorf("ScaledObject %s: activationLagThreshold %q must be a positive number (scale from zero and back)", s.Metadata.Name, m.ActivationLagThreshold)
		}
		if n, err := strconv.Atoi(m.LagThreshold); err != nil || n < 1 {
			t.Errorf("ScaledObject %s: lagThreshold %q must be a positive number", s.Metadata.Name, m.LagThreshold)
		}
		auth, ok := r.triggerAuths[tr.AuthenticationRef.Name]
		if !ok {
			t.Errorf("ScaledObject %s: TriggerAuthentication %q is not rendered", s.Metadata.Name, tr.AuthenticationRef.Name)
			continue
		}
		params := map[string]string{}
		for _, ref := range auth.Spec.SecretTargetRef {
			checkKey(t, "TriggerAuthentication "+auth.Metadata.Name, "Secret", ref.Name, ref.Key, secretKeys(r, ref.Name))
			params[ref.Parameter] = secretKeys(r, ref.Name)[ref.Key]
		}
		// The scaler must reach Kafka the way the workers do.
		if want := map[string]string{"SCRAM-SHA-512": "scram_sha512", "SCRAM-SHA-256": "scram_sha256", "PLAIN": "plaintext"}[settings["KFN_KAFKA_SASL_MECHANISM"]]; params["sasl"] != want {
			t.Errorf("TriggerAuthentication %s: sasl %q, but the workers use %q (want %q)", auth.Metadata.Name, params["sasl"], settings["KFN_KAFKA_SASL_MECHANISM"], want)
		}
		if (settings["KFN_KAFKA_TLS"] == "true") != (params["tls"] == "enable") {
			t.Errorf("TriggerAuthentication %s: tls %q, but the workers' KFN_KAFKA_TLS is %q", auth.Metadata.Name, params["tls"], settings["KFN_KAFKA_TLS"])
		}
	}
}

func ptrText(p *int64) string {
	if p == nil {
		return "(unset)"
	}
	return strconv.FormatInt(*p, 10)
}

// TestScaffoldManifestsAreValid renders the deploy/ folder `kfn new` writes
// into a function module and checks it as the example's: the API types,
// Pod Security "restricted", a pinned image, the migrate init container,
// probes on the paths the function binary serves, and a disruption budget.
func TestScaffoldManifestsAreValid(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "payments")
	kfnBin := filepath.Join(buildBinaries(t), "kfn")
	if out, err := exec.Command(kfnBin, "new", "payments", "--dir", dir, "--kfn", repoRoot).CombinedOutput(); err != nil {
		t.Fatalf("kfn new: %v: %s", err, out)
	}
	r := render(t, filepath.Join(dir, "deploy"))
	if len(r.deployments) != 1 || len(r.pdbs) != 1 {
		t.Fatalf("rendered %d Deployments and %d PodDisruptionBudgets; want 1 and 1", len(r.deployments), len(r.pdbs))
	}
	d := r.deployments[0]
	checkPodSecurity(t, d, imageUsers(t))
	checkGracePeriod(t, r, d)
	spec := d.Spec.Template.Spec
	if len(spec.InitContainers) != 1 || len(spec.InitContainers[0].Args) != 1 || spec.InitContainers[0].Args[0] != "migrate" {
		t.Errorf("want one init container running the function's migrate mode, got %+v", spec.InitContainers)
	}
	orders := help(t, "orders") // a function binary: every function takes the same settings
	for _, c := range append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...) {
		if !pinned.MatchString(c.Image) {
			t.Errorf("container %s: image %q is not pinned to a version", c.Name, c.Image)
		}
		if c.Resources.Requests.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() {
			t.Errorf("container %s: no cpu request or memory limit", c.Name)
		}
		for _, e := range c.Env {
			checkEnv(t, "container "+c.Name, orders, e.Name)
		}
	}
	worker := spec.Containers[0]
	env := map[string]string{"KFN_METRICS_ADDR": strings.TrimPrefix(worker.Args[0], "--metrics-addr=")}
	checkProbes(t, "container "+worker.Name, orders, worker, env)
	if sel := r.pdbs[0].Spec.Selector; sel == nil || sel.MatchLabels["app"] != "payments" {
		t.Errorf("the PodDisruptionBudget does not select the workers: %+v", sel)
	}
}
