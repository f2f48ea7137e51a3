package modgraph

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// toolGraph holds module path prefixes that come only from the development
// tools' graph (Task, its cloud SDKs and TUI libraries). None may appear in
// the module graph of a module that requires kfn.
var toolGraph = []string{
	"github.com/go-task",
	"github.com/aws/aws-sdk-go",
	"cloud.google.com",
	"charm.land",
}

// sharedGraphOnly are modules of the tools' graph that kfn's own graph
// holds too without building any of their packages: google.golang.org/grpc
// (required by the OpenTelemetry OTLP exporter's go.opentelemetry.io/proto/otlp)
// lists them in its go.mod. The test checks that a user's module still
// needs no package of theirs (go mod why -m).
var sharedGraphOnly = map[string]bool{
	"cloud.google.com/go/auth":             true,
	"cloud.google.com/go/compute/metadata": true,
}

// TestUserModuleDoesNotInheritToolDependencies makes a user's module that
// requires github.com/kfn-dev/kfn (replaced by this repository's root) and
// imports its runtime and runtime/worker (what a function binary imports),
// tidies it outside any workspace, and fails if its module graph holds a
// module of the tools' graph.
func TestUserModuleDoesNotInheritToolDependencies(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	// GOWORK=off: a user's module is never in this repository's workspace.
	// -mod=mod: go mod tidy and go list may fetch what the graph needs.
	env := append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
	run := func(dir string, args ...string) []byte {
		t.Helper()
		cmd := exec.CommandContext(ctx, "go", args...)
		cmd.Dir = dir
		cmd.Env = env
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go %s in %s: %v\n%s%s", strings.Join(args, " "), dir, err, out, stderr.Bytes())
		}
		return out
	}

	gomod := strings.TrimSpace(string(run(".", "env", "GOMOD")))
	if gomod == "" || gomod == os.DevNull {
		t.Fatalf("go env GOMOD = %q: not inside the kfn module", gomod)
	}
	root := filepath.Dir(gomod)
	var kfn struct {
		Module struct{ Path string }
		Go     string
	}
	if err := json.Unmarshal(run(root, "mod", "edit", "-json"), &kfn); err != nil {
		t.Fatalf("go mod edit -json: %v", err)
	}
	if kfn.Module.Path != "github.com/kfn-dev/kfn" {
		t.Fatalf("module at %s is %q, want github.com/kfn-dev/kfn", root, kfn.Module.Path)
	}

	user := t.TempDir()
	write := func(name, text string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(user, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("go.mod", "module example.com/kfnuser\n\ngo "+kfn.Go+"\n\n"+
		"require github.com/kfn-dev/kfn v0.0.0\n\n"+
		"replace github.com/kfn-dev/kfn => "+root+"\n")
	write("main.go", "package main\n\nimport (\n\t_ \"github.com/kfn-dev/kfn/runtime\"\n\t_ \"github.com/kfn-dev/kfn/runtime/worker\"\n)\n\nfunc main() {}\n")

	run(user, "mod", "tidy")
	var modules, inherited []string
	for _, line := range strings.Split(strings.TrimSpace(string(run(user, "list", "-m", "all"))), "\n") {
		path, _, _ := strings.Cut(line, " ")
		modules = append(modules, path)
		for _, prefix := range toolGraph {
			if !strings.HasPrefix(path, prefix) {
				continue
			}
			if sharedGraphOnly[path] && strings.Contains(string(run(user, "mod", "why", "-m", path)), "(main module does not need module") {
				continue
			}
			inherited = append(inherited, line)
		}
	}
	t.Logf("a module that imports github.com/kfn-dev/kfn/runtime and runtime/worker has %d modules in its graph (go list -m all)", len(modules))
	if len(inherited) > 0 {
		t.Errorf("its graph holds %d modules of the development tools' graph (move tool dependencies to tools/go.mod):\n  %s",
			len(inherited), strings.Join(inherited, "\n  "))
	}
}

// TestRuntimeBuildsNoAWSSDKPackage lists every package that kfn's runtime
// packages and the kafkaauth hook build (go list -deps, outside the
// workspace) and fails if one is the AWS SDK's: AWS_MSK_IAM's signing
// lives in the module kafkaauth/mskiam, which a user's main opts into.
func TestRuntimeBuildsNoAWSSDKPackage(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "list", "-deps", "github.com/kfn-dev/kfn/runtime/...", "github.com/kfn-dev/kfn/kafkaauth")
	cmd.Env = append(os.Environ(), "GOWORK=off")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, stderr.Bytes())
	}
	deps := strings.Split(strings.TrimSpace(string(out)), "\n")
	var aws []string
	for _, p := range deps {
		if strings.HasPrefix(p, "github.com/aws/") || strings.Contains(p, "aws_msk_iam") {
			aws = append(aws, p)
		}
	}
	t.Logf("runtime/... and kafkaauth build %d packages", len(deps))
	if len(aws) > 0 {
		t.Errorf("they build %d AWS packages (AWS_MSK_IAM belongs in the module kafkaauth/mskiam):\n  %s", len(aws), strings.Join(aws, "\n  "))
	}
}
