package deploy

import (
	"strconv"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// checkScraping checks that every kfn pod's /metrics is scraped three
// ways: the headless metrics Service (its selector matches every
// Deployment's pods, its target port is the container's metrics port), the
// Prometheus Operator's PodMonitor (it selects every pod, on the port by
// name, at the path kfn serves) and the prometheus.io annotations of a
// plain Prometheus (on the pod template, naming the metrics port's number).
func checkScraping(t *testing.T, r rendered) {
	t.Helper()
	if len(r.services) != 1 || len(r.podMonitors) != 1 {
		t.Fatalf("rendered %d Services and %d PodMonitors; want 1 metrics Service and 1 PodMonitor", len(r.services), len(r.podMonitors))
	}
	svc, pm := r.services[0], r.podMonitors[0]
	if svc.Spec.ClusterIP != corev1.ClusterIPNone {
		t.Errorf("Service %s: clusterIP %q, want None (headless: one endpoint per pod, a scrape must reach one worker)", svc.Name, svc.Spec.ClusterIP)
	}
	if len(svc.Spec.Ports) != 1 {
		t.Fatalf("Service %s: %d ports, want 1 (metrics)", svc.Name, len(svc.Spec.Ports))
	}
	if pm.APIVersion != "monitoring.coreos.com/v1" {
		t.Errorf("PodMonitor %s: apiVersion %q, want monitoring.coreos.com/v1", pm.Metadata.Name, pm.APIVersion)
	}
	if len(pm.Spec.PodMetricsEndpoints) != 1 {
		t.Fatalf("PodMonitor %s: %d podMetricsEndpoints, want 1", pm.Metadata.Name, len(pm.Spec.PodMetricsEndpoints))
	}
	ep := pm.Spec.PodMetricsEndpoints[0]
	if ep.Path != "/metrics" {
		t.Errorf("PodMonitor %s: path %q, want /metrics", pm.Metadata.Name, ep.Path)
	}
	svcSel := labels.SelectorFromSet(svc.Spec.Selector)
	pmSel, err := labels.ValidatedSelectorFromSet(pm.Spec.Selector.MatchLabels)
	if err != nil || len(pm.Spec.Selector.MatchLabels) == 0 {
		t.Fatalf("PodMonitor %s: selector %v: %v", pm.Metadata.Name, pm.Spec.Selector.MatchLabels, err)
	}
	if len(svc.Spec.Selector) == 0 {
		t.Fatalf("Service %s selects nothing", svc.Name)
	}
	for _, d := range r.deployments {
		pod := labels.Set(d.Spec.Template.Labels)
		port, ok := metricsPort(d)
		if !ok {
			t.Errorf("Deployment %s: container kfn has no port named metrics", d.Name)
			continue
		}
		if !svcSel.Matches(pod) {
			t.Errorf("Service %s (selector %v) does not select Deployment %s's pods (%v)", svc.Name, svc.Spec.Selector, d.Name, pod)
		}
		if tp := svc.Spec.Ports[0].TargetPort; tp.String() != port.Name && tp.IntValue() != int(port.ContainerPort) {
			t.Errorf("Service %s: targetPort %s is not Deployment %s's metrics port (%s, %d)", svc.Name, tp.String(), d.Name, port.Name, port.ContainerPort)
		}
		if !pmSel.Matches(pod) {
			t.Errorf("PodMonitor %s (selector %v) does not select Deployment %s's pods (%v)", pm.Metadata.Name, pm.Spec.Selector.MatchLabels, d.Name, pod)
		}
		if ep.Port != port.Name {
			t.Errorf("PodMonitor %s: port %q, want Deployment %s's metrics port name %q", pm.Metadata.Name, ep.Port, d.Name, port.Name)
		}
		for _, l := range pm.Spec.PodTargetLabels {
			if _, ok := pod[l]; !ok {
				t.Errorf("PodMonitor %s: podTargetLabels %s is not a label of Deployment %s's pods", pm.Metadata.Name, l, d.Name)
			}
		}
		a := d.Spec.Template.Annotations
		if a["prometheus.io/scrape"] != "true" || a["prometheus.io/path"] != "/metrics" || a["prometheus.io/port"] != strconv.Itoa(int(port.ContainerPort)) {
			t.Errorf("Deployment %s: pod annotations %v; want prometheus.io/scrape \"true\", prometheus.io/path /metrics, prometheus.io/port %d", d.Name, a, port.ContainerPort)
		}
	}
}

// metricsPort is the "metrics" port of a Deployment's kfn container (the
// one its probes use, KFN_METRICS_ADDR: checkProbes checks that).
func metricsPort(d appsv1.Deployment) (corev1.ContainerPort, bool) {
	for _, c := range d.Spec.Template.Spec.Containers {
		if c.Name != "kfn" {
			continue
		}
		for _, p := range c.Ports {
			if p.Name == "metrics" {
				return p, true
			}
		}
	}
	return corev1.ContainerPort{}, false
}
