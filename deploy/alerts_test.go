package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// alertTests is the promtool test file of the alert rules: for every
// alert, a series that makes it fire and one that keeps it quiet.
const alertTests = "alerts_test.yaml"

// TestAlertRules runs `promtool test rules` on the alert rules as they
// ship: the PrometheusRule of the rendered example overlay, whose
// spec.groups are written out as a plain rules file (promtool does not read
// the custom resource). promtool is built from the Prometheus module, a
// tool of the tools module (go tool promtool).
func TestAlertRules(t *testing.T) {
	groups := renderedRuleGroups(t)
	dir := t.TempDir()
	rules, err := yaml.Marshal(map[string]any{"groups": groups})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "kfn.rules.yaml"), rules, 0o644); err != nil {
		t.Fatal(err)
	}
	tests, err := os.ReadFile(alertTests)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, alertTests), tests, 0o644); err != nil {
		t.Fatal(err)
	}
	checkEveryAlertTested(t, groups, string(tests))

	out, err := promtool(t, "test", "rules", filepath.Join(dir, alertTests))
	t.Logf("promtool test rules:\n%s", out)
	if err != nil {
		t.Fatalf("promtool test rules: %v", err)
	}
}

// renderedRuleGroups renders the example overlay and returns the one
// PrometheusRule's spec.groups, unchanged (TestKubernetesManifestsAreValid
// decodes it strictly).
func renderedRuleGroups(t *testing.T) []any {
	t.Helper()
	rm, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), overlay)
	if err != nil {
		t.Fatalf("kustomize build %s: %v", overlay, err)
	}
	var groups []any
	n := 0
	for _, res := range rm.Resources() {
		if res.GetKind() != "PrometheusRule" {
			continue
		}
		n++
		m, err := res.Map()
		if err != nil {
			t.Fatal(err)
		}
		spec, _ := m["spec"].(map[string]any)
		groups, _ = spec["groups"].([]any)
	}
	if n != 1 || len(groups) == 0 {
		t.Fatalf("the overlay renders %d PrometheusRules (want 1), with %d groups", n, len(groups))
	}
	return groups
}

// checkEveryAlertTested checks that every alert has a runbook section link,
// a description, and a test that expects it to fire (exp_alerts) and one
// that evaluates it (an alert with no expected alerts at some eval_time,
// or a firing test whose other series stay quiet: promtool fails on any
// alert it did not expect).
func checkEveryAlertTested(t *testing.T, groups []any, tests string) {
	t.Helper()
	firing := map[string]bool{}
	block := regexp.MustCompile(`(?m)^\s+alertname: (\S+)\n(\s+exp_alerts:)?`)
	for _, m := range block.FindAllStringSubmatch(tests, -1) {
		if m[2] != "" {
			firing[m[1]] = true
		}
	}
	for _, g := range groups {
		rules, _ := g.(map[string]any)["rules"].([]any)
		for _, r := range rules {
			rule, _ := r.(map[string]any)
			name, _ := rule["alert"].(string)
			if name == "" {
				continue // a recording rule
			}
			ann, _ := rule["annotations"].(map[string]any)
			url, _ := ann["runbook_url"].(string)
			if want := "docs/production/alerts.md#" + strings.ToLower(name); !strings.HasSuffix(url, want) {
				t.Errorf("alert %s: runbook_url %q, want one ending in %s", name, url, want)
			}
			if d, _ := ann["description"].(string); d == "" {
				t.Errorf("alert %s: no description", name)
			}
			if !firing[name] {
				t.Errorf("alert %s: %s has no test in which it fires", name, alertTests)
			}
		}
	}
}

// promtool runs `go tool promtool` in the tools module (with or without
// the workspace: the tool is that module's).
func promtool(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command("go", append([]string{"tool", "promtool"}, args...)...)
	cmd.Dir = filepath.Join(repoRoot, "tools")
	out, err := cmd.CombinedOutput()
	return string(out), err
}
