package main

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"go/format"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"strings"
	"text/template"

	"github.com/kfn-dev/kfn/outbox"
)

//go:embed scaffold/*.tmpl
var scaffold embed.FS

var newHelp = help{
	usage: []string{"kfn new NAME [--topic T | --subject S] [--dir DIR] [--module M] [--kfn PATH]"},
	text: `
Scaffolds a function in a folder of its own (DIR, default ./NAME), as a Go
module: the handler, a unit test written with runtime/fntest, cmd/NAME/main.go,
a Containerfile, a kustomize folder (deploy/) and a README. It builds, and
its test passes, as generated (after go mod tidy, which it runs unless
--no-tidy).`,
	examples: `
kfn new payments --topic payments
kfn new receipts --subject payments.captured --module example.com/receipts
kfn new payments --kfn ../kfn          # against a local checkout of kfn`,
}

// scaffoldData fills the templates.
type scaffoldData struct {
	Name, Package, Module, Table string
	Topic, Subject, Source       string
	EmitSubject                  string
	KfnVersion, KfnReplace       string
}

var validFunctionName = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,62}$`)

func runNew(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("new", newHelp, stderr)
	topic := fs.String("topic", "", "the Kafka topic it consumes (default: NAME)")
	subject := fs.String("subject", "", "make it NATS-triggered: the subject it consumes")
	dir := fs.String("dir", "", "the folder to create (default: ./NAME)")
	module := fs.String("module", "", "the Go module path (default: NAME)")
	kfnPath := fs.String("kfn", "", "a local kfn checkout to build against (a replace directive)")
	noTidy := fs.Bool("no-tidy", false, "do not run go mod tidy")
	pos, err := parsePositional(fs, args, 1, 1, "the function's name")
	if err != nil {
		return err
	}
	name := pos[0]
	if !validFunctionName.MatchString(name) {
		return &usageError{msg: fmt.Sprintf("%q is not a function name: lower-case letters, digits, '-' and '_', starting with a letter", name)}
	}
	if *topic != "" && *subject != "" {
		return &usageError{msg: "give --topic or --subject, not both"}
	}
	if *subject != "" {
		if err := outbox.CheckSubjectPattern(*subject); err != nil {
			return &usageError{msg: "--subject: " + err.Error()}
		}
	} else if *topic == "" {
		*topic = name
	}
	d := scaffoldData{
		Name: name, Package: strings.ReplaceAll(name, "-", "_"), Module: *module,
		Topic: *topic, Subject: *subject, Source: *topic + *subject,
		EmitSubject: strings.ReplaceAll(name, "_", "-") + ".processed",
	}
	d.Table = d.Package + "_records"
	if d.Module == "" {
		d.Module = name
	}
	if *dir == "" {
		*dir = name
	}
	if *kfnPath != "" {
		abs, err := filepath.Abs(*kfnPath)
		if err != nil {
			return err
		}
		if _, err := os.Stat(filepath.Join(abs, "go.mod")); err != nil {
			return &usageError{msg: fmt.Sprintf("--kfn %s is not a kfn checkout: %v", *kfnPath, err)}
		}
		d.KfnReplace, d.KfnVersion = abs, "v0.0.0-00010101000000-000000000000"
	} else if d.KfnVersion = kfnModuleVersion(); d.KfnVersion == "" {
		return &usageError{msg: "this kfn was built from a checkout, not a release, so it cannot say which kfn version to require: pass --kfn PATH (that checkout)"}
	}
	if entries, err := os.ReadDir(*dir); err == nil && len(entries) > 0 {
		return fmt.Errorf("%s exists and is not empty: choose another --dir", *dir)
	} else if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	files := map[string]string{
		"go.mod.tmpl":             "go.mod",
		"function.go.tmpl":        d.Package + ".go",
		"function_test.go.tmpl":   d.Package + "_test.go",
		"main.go.tmpl":            filepath.Join("cmd", name, "main.go"),
		"Containerfile.tmpl":      "Containerfile",
		"kustomization.yaml.tmpl": filepath.Join("deploy", "kustomization.yaml"),
		"deployment.yaml.tmpl":    filepath.Join("deploy", "deployment.yaml"),
		"README.md.tmpl":          "README.md",
	}
	for tmpl, out := range files {
		if err := writeScaffold(tmpl, filepath.Join(*dir, out), d); err != nil {
			return err
		}
	}
	fmt.Fprintf(stdout, "created %s in %s (module %s)\n", name, *dir, d.Module)
	if !*noTidy {
		if err := goIn(ctx, *dir, stdout, stderr, "mod", "tidy"); err != nil {
			return fmt.Errorf("go mod tidy in %s: %w (fix, then run it yourself)", *dir, err)
		}
	}
	fmt.Fprintf(stdout, "next: cd %s && go test ./... ; then see its README.md\n", *dir)
	return nil
}

func writeScaffold(tmpl, path string, d scaffoldData) error {
	text, err := scaffold.ReadFile("scaffold/" + tmpl)
	if err != nil {
		return err
	}
	t, err := template.New(tmpl).Option("missingkey=error").Parse(string(text))
	if err != nil {
		return fmt.Errorf("scaffold %s: %w", tmpl, err)
	}
	var buf bytes.Buffer
	if err := t.Execute(&buf, d); err != nil {
		return fmt.Errorf("scaffold %s: %w", tmpl, err)
	}
	out := buf.Bytes()
	if strings.HasSuffix(path, ".go") {
		if out, err = format.Source(out); err != nil {
			return fmt.Errorf("scaffold %s: generated Go does not parse: %w", tmpl, err)
		}
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, out, 0o644)
}

// kfnModuleVersion is the version of kfn this binary was built from, when
// it is a release (not "(devel)").
func kfnModuleVersion() string {
	info, ok := debug.ReadBuildInfo()
	if !ok || info.Main.Path != "github.com/kfn-dev/kfn" || info.Main.Version == "" || info.Main.Version == "(devel)" {
		return ""
	}
	return info.Main.Version
}
