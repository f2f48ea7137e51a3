// Command kfn is the operator's tool: it runs the local development stack,
// migrates the schema, shows who owns what, replays partitions, inspects dead
// letters and benchmarks the record path.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"

	"github.com/kfn-dev/kfn/internal/settings"
)

// command is one kfn subcommand.
type command struct {
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

var commands = map[string]command{
	"dev":     {"run the whole stack locally with sample traffic", runDev},
	"migrate": {"apply kfn's schema migrations to a database", runMigrate},
	"status":  {"show partitions: owner, epoch, cursor, lag", runStatus},
	"replay":  {"move a partition's cursor back to an offset", runReplay},
	"dlq":     {"list dead letters, or park a stuck record (dlq park)", runDLQ},
	"bench":   {"benchmark exactly-once against at-least-once and naive", runBench},
	"relay":   {"run the outbox relay on its own (for workers started with --no-relay)", runRelay},
	"version": {"print kfn's version, VCS revision and Go version", runVersion},
	"topic":   {"create, list and describe Kafka topics", runTopic},
	"produce": {"send records to a topic, from flags or JSON lines", runProduce},
	"tail":    {"print the events functions emit on a subject, as they arrive", runTail},
	"new":     {"scaffold a function: handler, unit test, main, Containerfile, deploy/", runNew},
}

// usageError is a mistake in how kfn was called: exit code 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stderr)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	cmd, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "kfn: unknown command %q\n\n", args[0])
		usage(stderr)
		return 2
	}
	err := cmd.run(ctx, args[1:], stdout, stderr)
	var uerr *usageError
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &uerr):
		fmt.Fprintf(stderr, "kfn %s: %s (see kfn %s -h)\n", args[0], uerr.msg, args[0])
		return 2
	default:
		fmt.Fprintf(stderr, "kfn %s: %v\n", args[0], err)
		return 1
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: kfn <command> [flags]\n\ncommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-8s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w, "\nrun `kfn <command> -h` for its flags")
}

// flagSet is a subcommand's flag set. Its shared settings (connections,
// lease bucket, worker and relay tuning) are declared in internal/settings,
// each with its environment variable; its own flags are plain flags.
type flagSet struct {
	*flag.FlagSet
	settings *settings.Binder
}

// newFlags makes a flag set that reports errors instead of exiting, with
// output to stderr.
func newFlags(name string, stderr io.Writer) *flagSet {
	fs := flag.NewFlagSet("kfn "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: kfn %s [flags]\n\n", name)
		printFlags(fs)
	}
	return &flagSet{FlagSet: fs, settings: settings.NewBinder(fs)}
}

// printFlags lists the flags of fs, with the environment variable of each
// shared setting in brackets.
func printFlags(fs *flag.FlagSet) {
	n := 0
	fs.VisitAll(func(*flag.Flag) { n++ })
	if n == 0 {
		fmt.Fprintln(fs.Output(), "no flags")
		return
	}
	fmt.Fprintln(fs.Output(), "flags (a variable in brackets sets the flag from the environment):")
	settings.PrintDefaults(fs)
}

// bind adds setting s to fs and returns where its value will be.
func bind[T any](fs *flagSet, s settings.Setting[T]) *T {
	p := new(T)
	s.Bind(fs.settings, p)
	return p
}

// parse parses args and rejects stray positional arguments and the shared
// settings' bad values.
func parse(fs *flagSet, args []string) error {
	_, err := parsePositional(fs, args, 0, 0, "no arguments")
	return err
}

// given reports whether the flag name was on the command line.
func given(fs *flagSet, name string) bool {
	found := false
	fs.Visit(func(f *flag.Flag) { found = found || f.Name == name })
	return found
}

// required says that a flag the command needs is missing.
func required(name, value string) error {
	if strings.TrimSpace(value) == "" {
		return &usageError{msg: fmt.Sprintf("--%s is required", name)}
	}
	return nil
}

// requiredSetting says that a shared setting the command needs is missing,
// naming its environment variable too.
func requiredSetting(s settings.Setting[string], value string) error {
	if strings.TrimSpace(value) == "" {
		return &usageError{msg: fmt.Sprintf("--%s is required (or set %s)", s.Flag, s.Env)}
	}
	return nil
}
