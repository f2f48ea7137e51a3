// Command kfn is the operator's tool: it runs the local development stack,
// migrates the schema, shows who owns what, replays partitions, inspects and
// discards dead letters, reads the audit log and benchmarks the record path.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/kfn-dev/kfn/internal/buildinfo"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/runtime"
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
	"replay":  {"move cursors back, from an offset or a time, with --dry-run", runReplay},
	"dlq":     {"dead letters: list, show, discard, purge; park a stuck record", runDLQ},
	"audit":   {"list the audit log: replays, parks, discards, purges, …", runAudit},
	"bench":   {"benchmark exactly-once against at-least-once and naive", runBench},
	"relay":   {"run the outbox relay on its own (for workers started with --no-relay)", runRelay},
	"version": {"print kfn's version, commit, build time and Go version (also kfn --version)", runVersion},
	"topic":   {"create, list and describe Kafka topics", runTopic},
	"produce": {"send records to a topic, from flags or JSON lines", runProduce},
	"tail":    {"print the events functions emit on a subject, as they arrive", runTail},
	"verify":  {"check a function applied every record exactly once (read-only)", runVerify},
	"console": {"serve a web console: lanes, dead letters, replay, audit, verify", runConsole},
	"new":     {"scaffold a function: handler, unit test, main, Containerfile, deploy/", runNew},
}

// usageError is a mistake in how kfn was called: exit code 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

// exitError ends kfn with its own exit code, printing err when there is
// one: kfn verify exits 1 when it found a violation (the report says
// which) and 2 when it could not check.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string {
	if e.err == nil {
		return fmt.Sprintf("exit code %d", e.code)
	}
	return e.err.Error()
}

func (e *exitError) Unwrap() error { return e.err }

// commandError is the error of a subcommand with a name of more than one
// word ("dlq discard"), so that its messages name it.
type commandError struct {
	command string
	err     error
}

func (e *commandError) Error() string { return e.err.Error() }
func (e *commandError) Unwrap() error { return e.err }

// inCommand names the command err comes from; nil stays nil.
func inCommand(command string, err error) error {
	if err == nil {
		return nil
	}
	return &commandError{command: command, err: err}
}

// errSchemaMissing replaces Postgres's error about a kfn table or the kfn
// schema that does not exist.
var errSchemaMissing = errors.New("the kfn schema is missing in this database: run `kfn migrate`")

// explain turns errors an operator cannot act on as they are into ones that
// say what to do: a missing kfn schema (SQLSTATE 42P01 undefined_table or
// 3F000 invalid_schema_name on kfn's own tables) asks for kfn migrate.
func explain(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000") &&
		(strings.Contains(pgErr.Message, `"kfn.`) || strings.Contains(pgErr.Message, `"kfn"`)) {
		return errSchemaMissing
	}
	return err
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	if args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stdout)
		return 0
	}
	if buildinfo.Requested(args[:1]) {
		args = append([]string{"version"}, args[1:]...) // kfn --version is kfn version
	}
	cmd, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "kfn: unknown command %q (see kfn -h)\n", args[0])
		return 2
	}
	appName = "kfn " + args[0]
	err := cmd.run(ctx, args[1:], stdout, stderr)
	name := args[0]
	var cerr *commandError
	if errors.As(err, &cerr) {
		name = cerr.command
	}
	var uerr *usageError
	var xerr *exitError
	var herr *helpRequest
	var ferr *operator.UnknownFilterError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &herr):
		herr.print(stdout)
		return 0
	case errors.As(err, &xerr):
		if xerr.err != nil {
			fmt.Fprintf(stderr, "kfn %s: %v\n", name, explain(xerr.err))
		}
		return xerr.code
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &ferr), errors.Is(err, operator.ErrNoCursor):
		fmt.Fprintf(stderr, "kfn %s: %v (see kfn %s -h)\n", name, err, name)
		return 2
	case errors.As(err, &uerr):
		fmt.Fprintf(stderr, "kfn %s: %s (see kfn %s -h)\n", name, strings.ReplaceAll(uerr.msg, "\n", "; "), name)
		return 2
	default:
		fmt.Fprintf(stderr, "kfn %s: %v\n", name, explain(err))
		return 1
	}
}

// usage is kfn's own -h: its commands.
func usage(w io.Writer) {
	help{
		usage:    []string{"kfn <command> [flags]"},
		text:     "Run `kfn <command> -h` for a command's flags, `kfn --version` for the version.",
		commands: commands,
	}.print(w, nil)
}

// flagSet is a subcommand's flag set. Its shared settings (connections,
// lease bucket, worker and relay tuning) are declared in internal/settings,
// each with its environment variable; its own flags are plain flags.
type flagSet struct {
	*flag.FlagSet
	settings *settings.Binder
	help     help
}

// newFlags makes a flag set that reports errors instead of exiting and
// prints nothing itself: parse turns -h into a helpRequest (run prints h
// and the flags to stdout, exit 0) and a bad or unknown flag into a
// one-line usageError (exit 2). stderr is unused and kept for the
// callers' sake.
func newFlags(name string, h help, stderr io.Writer) *flagSet {
	_ = stderr
	fs := flag.NewFlagSet("kfn "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return &flagSet{FlagSet: fs, settings: settings.NewBinder(fs), help: h}
}

// helpRequest is -h or --help: run prints the command's help to stdout and
// exits 0. It wraps flag.ErrHelp.
type helpRequest struct {
	help help
	fs   *flag.FlagSet // nil for a group of subcommands without flags
}

func (*helpRequest) Error() string { return flag.ErrHelp.Error() }
func (*helpRequest) Unwrap() error { return flag.ErrHelp }

// print writes the help, and the flags if there are any, to w.
func (r *helpRequest) print(w io.Writer) {
	if r.fs != nil {
		r.fs.SetOutput(w)
	}
	r.help.print(w, r.fs)
}

// bind adds setting s to fs and returns where its value will be.
// bindKafkaSecurity binds the Kafka TLS and SASL settings (see package
// kafkaconn) to fs.
func bindKafkaSecurity(fs *flagSet) *runtime.KafkaSecurity {
	s := new(runtime.KafkaSecurity)
	kafkaconn.BindSecurity(fs.settings, s)
	return s
}

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

// parseWithArgs is parse for a command that takes any number of positional
// arguments (ids) before, between or after its flags; it returns them in
// order.
func parseWithArgs(fs *flagSet, args []string) ([]string, error) {
	return parsePositional(fs, args, 0, math.MaxInt, "ids")
}

// settingErrors reports the shared settings' bad values, once fs is parsed.
func settingErrors(fs *flagSet) error {
	if errs := fs.settings.Errors(); len(errs) > 0 {
		msgs := make([]string, len(errs))
		for i, e := range errs {
			msgs[i] = e.Error()
		}
		return &usageError{msg: strings.Join(msgs, "\n")}
	}
	return nil
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

// writeJSON prints v as indented JSON, for scripts.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// requiredSetting says that a shared setting the command needs is missing,
// naming its environment variable too.
func requiredSetting(s settings.Setting[string], value string) error {
	if strings.TrimSpace(value) == "" {
		return &usageError{msg: fmt.Sprintf("--%s is required (or set %s)", s.Flag, s.Env)}
	}
	return nil
}
