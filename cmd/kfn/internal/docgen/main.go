// Command docgen writes the two references that are generated, never
// written by hand: docs/reference/cli.md, from what `kfn CMD -h` prints
// for every command and subcommand, and docs/reference/configuration.md,
// from the settings table (internal/settings.Table), with the commands
// each setting applies to read from those same -h pages and from a
// function binary's. It builds kfn and runs it, so the reference is the
// help a user sees. `go generate ./...` runs it; TestReferencesAreCurrent
// fails when a committed reference differs from what it would write.
package main

//go:generate go run .

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// The references, relative to the repository's root.
const (
	cliPath           = "docs/reference/cli.md"
	configurationPath = "docs/reference/configuration.md"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "docgen:", err)
		os.Exit(1)
	}
}

func run() error {
	root, err := repoRoot()
	if err != nil {
		return err
	}
	tmp, err := os.MkdirTemp("", "kfn-docgen")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	kfn, err := buildKFN(root, tmp)
	if err != nil {
		return err
	}
	refs, err := render(kfn)
	if err != nil {
		return err
	}
	for path, text := range refs {
		full := filepath.Join(root, path)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(full, text, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// render returns each reference's path and text, from the kfn binary at
// kfn.
func render(kfn string) (map[string][]byte, error) {
	tree, err := readCommands(kfnHelp(kfn))
	if err != nil {
		return nil, err
	}
	workers, err := functionFlags()
	if err != nil {
		return nil, err
	}
	return map[string][]byte{
		cliPath:           renderCLI(tree),
		configurationPath: renderConfiguration(tree, workers),
	}, nil
}

// repoRoot is the nearest directory up from here with a go.mod: kfn's
// module.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory: run docgen inside the kfn repository")
		}
		dir = parent
	}
}

// buildKFN builds cmd/kfn of the module at root into dir.
func buildKFN(root, dir string) (string, error) {
	bin := filepath.Join(dir, "kfn")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/kfn")
	cmd.Dir = root
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("go build ./cmd/kfn: %v\n%s", err, out.String())
	}
	return bin, nil
}

// kfnHelp returns what the kfn binary at kfn prints for `kfn ARGS… -h`,
// run with no environment but PATH, so that no variable of this shell
// changes it.
func kfnHelp(kfn string) func(args ...string) (string, error) {
	return func(args ...string) (string, error) {
		cmd := exec.Command(kfn, append(args, "-h")...)
		cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			return "", fmt.Errorf("kfn %v -h: %v\n%s", args, err, out.String())
		}
		return out.String(), nil
	}
}
