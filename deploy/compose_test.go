package deploy

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/loader"
	"github.com/compose-spec/compose-go/v2/types"
)

// TestComposeFilesAreValid loads every compose file offline with
// compose-go (schema validation and consistency checks on) and checks the
// stack's order, health checks and volumes, and that every variable and
// flag given to a kfn container exists in its binary.
func TestComposeFilesAreValid(t *testing.T) {
	files, err := filepath.Glob("compose/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no compose files under deploy/compose (%v)", err)
	}
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			p := loadCompose(t, file)
			oneShot := map[string]bool{}
			for _, s := range p.Services {
				for dep, d := range s.DependsOn {
					switch d.Condition {
					case types.ServiceConditionCompletedSuccessfully:
						oneShot[dep] = true
					case types.ServiceConditionHealthy:
						if p.Services[dep].HealthCheck == nil {
							t.Errorf("service %s waits for %s to be healthy, which has no health check", s.Name, dep)
						}
					default:
						t.Errorf("service %s depends on %s with condition %q: want service_healthy or service_completed_successfully", s.Name, dep, d.Condition)
					}
				}
			}
			for _, s := range p.Services {
				hc := s.HealthCheck
				if !oneShot[s.Name] && (hc == nil || hc.Disable || len(hc.Test) < 2) {
					t.Errorf("service %s runs for good but has no health check", s.Name)
				}
				if s.Image != "" && !strings.Contains(s.Image, ":") || strings.HasSuffix(s.Image, ":latest") {
					t.Errorf("service %s: image %q is not pinned to a version", s.Name, s.Image)
				}
				if s.Build != nil {
					checkKfnService(t, s)
				}
			}
			checkNamedVolume(t, p, "postgres", "/var/lib/postgresql/data")
			checkNamedVolume(t, p, "nats", "/data")
			kafka := p.Services["kafka"].Environment["KAFKA_ADVERTISED_LISTENERS"]
			if kafka == nil || !strings.Contains(*kafka, "//kafka:") {
				t.Errorf("Kafka must advertise an address other containers reach (its service name, kafka:PORT), got %v", kafka)
			}
			if _, ok := p.Services["topics"]; !ok || !oneShot["topics"] {
				t.Errorf("no one-shot topic step (kfn topic create … --if-not-exists) that the workers wait for")
			}
		})
	}
}

// loadCompose loads file offline, validated, without the caller's
// environment (the file must not depend on it).
func loadCompose(t *testing.T, file string) *types.Project {
	t.Helper()
	abs, err := filepath.Abs(file)
	if err != nil {
		t.Fatal(err)
	}
	content, err := os.ReadFile(abs)
	if err != nil {
		t.Fatal(err)
	}
	p, err := loader.LoadWithContext(context.Background(), types.ConfigDetails{
		WorkingDir:  filepath.Dir(abs),
		ConfigFiles: []types.ConfigFile{{Filename: abs, Content: content}},
		Environment: types.Mapping{},
	}, func(o *loader.Options) { o.ResolvePaths = true })
	if err != nil {
		t.Fatalf("compose-go: %v", err)
	}
	for name, s := range p.Secrets {
		if _, err := os.Stat(s.File); err != nil {
			t.Errorf("secret %s: %v", name, err)
		}
	}
	return p
}

// checkKfnService checks a service built from this checkout: its binary
// knows every variable it is given and every flag of its command and its
// health check.
func checkKfnService(t *testing.T, s types.ServiceConfig) {
	t.Helper()
	pkg := s.Build.Args["PKG"]
	if pkg == nil {
		t.Errorf("service %s: build without a PKG argument", s.Name)
		return
	}
	name := filepath.Base(*pkg)
	// The image is tagged with the version its binary is stamped with
	// (KFN_VERSION, the release's version).
	repo := "ghcr.io/kfn-dev/kfn-" + name
	if name == "kfn" {
		repo = "ghcr.io/kfn-dev/kfn"
	}
	version := "(none)"
	if v := s.Build.Args["VERSION"]; v != nil {
		version = *v
	}
	if s.Image != repo+":"+version {
		t.Errorf("service %s: image %q, VERSION build argument %s: want %s:VERSION, both from KFN_VERSION", s.Name, s.Image, version, repo)
	}
	if _, err := os.Stat(filepath.Join(repoRoot, *pkg)); err != nil {
		t.Errorf("service %s: PKG %s: %v", s.Name, *pkg, err)
		return
	}
	var b binary
	args := []string(s.Command)
	if name == "kfn" {
		b, args = kfnCommand(t, args)
	} else {
		b = help(t, name)
	}
	where := "service " + s.Name
	checkArgs(t, where, b, args)
	for k := range s.Environment {
		checkEnv(t, where, b, k)
	}
	if v := s.Environment["DATABASE_URL"]; v != nil {
		t.Errorf("%s: DATABASE_URL in plain sight; use a secret and DATABASE_URL_FILE", where)
	}
	if hc := s.HealthCheck; hc != nil && len(hc.Test) > 2 && hc.Test[0] == "CMD" && hc.Test[1] == "/function" {
		hcArgs := hc.Test[2:]
		if name == "kfn" {
			var hb binary
			if hb, hcArgs = kfnCommand(t, hcArgs); hb.name != b.name {
				t.Errorf("%s: the health check runs %s, not the service's %s", where, hb.name, b.name)
			}
		}
		checkArgs(t, where+" (health check)", b, hcArgs)
	}
}

func checkNamedVolume(t *testing.T, p *types.Project, service, target string) {
	t.Helper()
	for _, v := range p.Services[service].Volumes {
		if v.Type == types.VolumeTypeVolume && v.Target == target {
			if _, ok := p.Volumes[v.Source]; ok {
				return
			}
		}
	}
	t.Errorf("service %s: no named volume on %s", service, target)
}

// TestComposeUsesTheVersionsTheTestsUse: the compose stack runs the NATS
// server the tests embed (the nats-server module of kfn's go.mod) and the
// Apache Kafka the tests start (deploy/local/kafka/pom.xml), so that what a
// user runs locally is what CI tested.
func TestComposeUsesTheVersionsTheTestsUse(t *testing.T) {
	p := loadCompose(t, "compose/compose.yaml")
	gomod, err := os.ReadFile("../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	nats := regexp.MustCompile(`(?m)^\s*github\.com/nats-io/nats-server/v2 v(\S+)`).FindSubmatch(gomod)
	pom, err := os.ReadFile("local/kafka/pom.xml")
	if err != nil {
		t.Fatal(err)
	}
	kafka := regexp.MustCompile(`<kafka\.version>([^<]+)</kafka\.version>`).FindSubmatch(pom)
	if nats == nil || kafka == nil {
		t.Fatalf("cannot find the nats-server version in go.mod (%q) or kafka.version in pom.xml (%q)", nats, kafka)
	}
	for service, want := range map[string]string{
		"nats":  "docker.io/library/nats:" + string(nats[1]) + "-alpine",
		"kafka": "docker.io/apache/kafka:" + string(kafka[1]),
	} {
		if got := p.Services[service].Image; got != want {
			t.Errorf("service %s runs %s; the tests use %s", service, got, want)
		}
	}
}
