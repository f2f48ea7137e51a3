package deploy

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
)

// binary is what a kfn binary (or one kfn subcommand) accepts, read from
// its -h: the flags and the environment variables it names.
type binary struct {
	name  string
	flags map[string]bool
	envs  map[string]bool
	text  string // the -h output
}

// function is what a function binary's --describe prints.
type function struct {
	Name    string `json:"name"`
	Topic   string `json:"topic"`
	Subject string `json:"subject"`
}

var (
	buildOnce sync.Once
	binDir    string // made and removed by TestMain
	buildErr  error
)

// repoRoot is the main module's directory, this module's parent.
const repoRoot = ".."

func TestMain(m *testing.M) {
	var err error
	if binDir, err = os.MkdirTemp("", "kfn-deploy-bin-"); err != nil {
		panic(err)
	}
	code := m.Run()
	os.RemoveAll(binDir)
	os.Exit(code)
}

// buildBinaries builds kfn and the bundled functions once per test run,
// from the main module alone (GOWORK=off), as the images do.
func buildBinaries(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		cmd := exec.Command("go", "build", "-o", binDir+string(filepath.Separator),
			"./cmd/kfn", "./functions/orders/cmd/orders", "./functions/ledger/cmd/ledger")
		cmd.Dir = repoRoot
		cmd.Env = append(os.Environ(), "GOWORK=off")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = &buildError{out: string(out), err: err}
		}
	})
	if buildErr != nil {
		t.Fatalf("build the kfn binaries: %v", buildErr)
	}
	return binDir
}

type buildError struct {
	out string
	err error
}

func (e *buildError) Error() string { return e.err.Error() + ": " + e.out }

var (
	flagLine = regexp.MustCompile(`(?m)^\s+-([a-z0-9][a-z0-9-]*)\b`)
	envName  = regexp.MustCompile(`\b(KFN_[A-Z0-9_]+|DATABASE_URL(?:_FILE)?)\b`)
)

// help runs a binary (args: a kfn subcommand, or none) with -h and returns
// what it accepts. Every setting's variable is named in the -h text, so an
// environment variable it does not name is unknown to it.
func help(t *testing.T, name string, args ...string) binary {
	t.Helper()
	path := filepath.Join(buildBinaries(t), name)
	out, _ := exec.Command(path, append(append([]string{}, args...), "-h")...).CombinedOutput() // -h exits 0 or 2 depending on the binary
	b := binary{name: strings.Join(append([]string{name}, args...), " "), flags: map[string]bool{}, envs: map[string]bool{}, text: string(out)}
	for _, m := range flagLine.FindAllStringSubmatch(string(out), -1) {
		b.flags[m[1]] = true
	}
	for _, m := range envName.FindAllStringSubmatch(string(out), -1) {
		b.envs[m[1]] = true
	}
	if len(b.flags) == 0 || len(b.envs) == 0 {
		t.Fatalf("%s -h lists no flags or no variables:\n%s", b.name, out)
	}
	return b
}

// describe runs a function binary with --describe.
func describe(t *testing.T, name string) function {
	t.Helper()
	out, err := exec.Command(filepath.Join(buildBinaries(t), name), "--describe").Output()
	if err != nil {
		t.Fatalf("%s --describe: %v", name, err)
	}
	var f function
	if err := json.Unmarshal(out, &f); err != nil {
		t.Fatalf("%s --describe: %v: %s", name, err, out)
	}
	return f
}

// checkArgs checks that every --flag (or -flag) in args is one b accepts.
func checkArgs(t *testing.T, where string, b binary, args []string) {
	t.Helper()
	for _, a := range args {
		if !strings.HasPrefix(a, "-") {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !b.flags[name] {
			t.Errorf("%s: flag %s is not a flag of %s", where, a, b.name)
		}
	}
}

// checkEnv checks that b knows the environment variable name.
func checkEnv(t *testing.T, where string, b binary, name string) {
	t.Helper()
	if !b.envs[name] {
		t.Errorf("%s: environment variable %s is unknown to %s (see %s -h)", where, name, b.name, b.name)
	}
}

// kfnCommand returns what the kfn command that args run accepts (its
// leading words: "relay", "topic create orders") and the args after them.
func kfnCommand(t *testing.T, args []string) (binary, []string) {
	t.Helper()
	n := 0
	for n < len(args) && !strings.HasPrefix(args[n], "-") {
		n++
	}
	if n == 0 {
		t.Fatalf("kfn %v: no subcommand", args)
	}
	return help(t, "kfn", args[:n]...), args[n:]
}
