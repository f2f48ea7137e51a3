package process

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/kfn-dev/kfn/internal/buildinfo"
	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/internal/logsetup"
	"github.com/kfn-dev/kfn/internal/observe"
	"github.com/kfn-dev/kfn/internal/preflight"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/internal/tracing"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// Main runs fn as a process (runtime/worker's Start and Main): it parses
// args, writes what was asked for (-h, --version, --describe) to stdout
// and errors and logs to stderr, and returns the process exit code: 0, 2
// for a usage or configuration error (one line naming the flag and the
// value, and where help is), 1 when a service cannot be used.
// With the first argument "migrate" it runs the migrate mode instead of a
// worker: kfn's schema migrations and fn's Setup, then exit.
func Main(fn kfn.Function, args []string, stdout, stderr io.Writer) int {
	name := fn.Name
	if name == "" {
		name = "kfn-function"
	}
	if buildinfo.Requested(args) { // --version, also after migrate
		fmt.Fprint(stdout, buildinfo.Read().Text(name))
		return 0
	}
	if len(args) > 0 && args[0] == preflight.MigrateCommand {
		return migrateMain(fn, name, args[1:], stdout, stderr)
	}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stdout) // -h: the usage is what was asked for
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage of %s (every flag can also be set by the environment variable in brackets):\n", name)
		settings.PrintDefaults(fs)
		fmt.Fprintf(fs.Output(), "\n%s %s applies kfn's schema migrations and the function's Setup, then exits (-h for its flags).\n", name, preflight.MigrateCommand)
		fmt.Fprintf(fs.Output(), "%s --version prints its version, commit and build time.\n", name)
	}
	var cfg kfn.Config
	var logLevel, metricsAddr string
	b := settings.NewBinder(fs)
	preflight.BindConfig(b, &cfg) // b's errors, the log level's and metrics address's too, are reported by NewWorker
	settings.LogLevel.Bind(b, &logLevel)
	settings.MetricsAddr.Bind(b, &metricsAddr)
	describe := fs.Bool("describe", false, "print the function's name, source and emitted subjects as JSON on stdout, and exit (kfn dev reads it)")
	healthcheck := fs.Bool("healthcheck", false, observe.HealthcheckUsage)
	if code, ok := parseArgs(fs, args, name, stderr); !ok {
		return code
	}
	if fs.NArg() > 0 && fs.Arg(0) == preflight.MigrateCommand {
		fmt.Fprintf(stderr, "%s: %s must come first: %s %s --%s … (see %s -h)\n", name, preflight.MigrateCommand, name, preflight.MigrateCommand, settings.DatabaseURL.Flag, name)
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "%s: unexpected argument %q: every setting is a --flag (see %s -h)\n", name, fs.Arg(0), name)
		return 2
	}
	if errs := b.Errors(); len(errs) > 0 {
		fmt.Fprintf(stderr, "%s: %s (see %s -h)\n", name, settingsLine(errs), name)
		return 2
	}
	if *describe {
		if err := json.NewEncoder(stdout).Encode(Describe(fn)); err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", name, err)
			return 1
		}
		return 0
	}
	if *healthcheck {
		if err := observe.ProbeReady(context.Background(), metricsAddr); err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", name, err)
			return 1
		}
		return 0
	}
	var level slog.Level
	_ = level.UnmarshalText([]byte(logLevel))                                        // checked by settings.LogLevel; a rejected value left "info"
	cfg.Logger = slog.New(tracing.LogHandler(logsetup.New(stderr, level).Handler())) // a record logged inside a span carries trace_id, span_id
	slog.SetDefault(cfg.Logger)                                                      // a handler's slog.InfoContext(ctx, …) lines go to the worker's log

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	w, err := engine.NewWorker(ctx, cfg, fn)
	if err != nil && ctx.Err() != nil {
		return 0 // stopped (SIGTERM) while starting: nothing ran, nothing to report
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: %s\n", name, strings.ReplaceAll(err.Error(), "\n", "\n  "))
		var cfgErr *preflight.ConfigError
		if errors.As(err, &cfgErr) {
			return 2
		}
		return 1
	}
	// After NewWorker, whose configuration errors are then the first and
	// only line a misconfigured start prints; before Run, whose memory
	// check (worker_memory.go) reads the limit.
	setMemoryLimit(cfg.Logger)
	if metricsAddr != "" {
		ln, err := net.Listen("tcp", metricsAddr)
		if err != nil {
			w.Close()
			fmt.Fprintf(stderr, "%s: invalid --%s (%s) %q: %v\n", name, settings.MetricsAddr.Flag, settings.MetricsAddr.Env, metricsAddr, err)
			return 2
		}
		// The bound address, for a port chosen by the kernel (":0").
		cfg.Logger.Info("serving metrics", "addr", ln.Addr().String())
		srv := &http.Server{Handler: w.HTTPHandler(), ReadHeaderTimeout: 5 * time.Second}
		go srv.Serve(ln)                         //nolint:errcheck // ends with Shutdown below
		defer srv.Shutdown(context.Background()) //nolint:errcheck // best effort at exit
	}
	cfg.Logger.Info("worker started", "function", fn.Name, "source", engine.Source(fn), "worker", cfg.WithDefaults().WorkerID, "schema", schema.Latest())
	// The signal's arrival, logged: the start of the shutdown, which the
	// next owners' claims are measured from.
	signalled := make(chan time.Time, 1)
	logSignal := context.AfterFunc(ctx, func() {
		signalled <- time.Now()
		cfg.Logger.Info("stopping: fetching no more records; in-flight batches commit or roll back, then the leases are released", "cause", context.Cause(ctx).Error())
	})
	defer logSignal()
	if err := w.Run(ctx); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return 1
	}
	stopped := []any{"function", fn.Name}
	if ctx.Err() != nil { // always, as Run returns nil only once ctx ended
		stopped = append(stopped, "shutdown_took", time.Since(<-signalled))
	}
	cfg.Logger.Info("worker stopped cleanly", stopped...)
	return 0
}

// parseArgs parses a function binary's args (cmd names it in messages):
// on -h it prints the usage to the flag set's output and returns 0, on a
// bad flag or value one line on stderr and 2; ok says go on.
func parseArgs(fs *flag.FlagSet, args []string, cmd string, stderr io.Writer) (code int, ok bool) {
	err := settings.QuietParse(fs, args)
	switch {
	case err == nil:
		return 0, true
	case errors.Is(err, flag.ErrHelp):
		fs.Usage()
		return 0, false
	}
	fmt.Fprintf(stderr, "%s: %s (see %s -h)\n", cmd, settings.FlagErrorLine(fs, err), cmd)
	return 2, false
}

// settingsLine is the given values that cannot be used, on one line.
func settingsLine(errs []*settings.Error) string {
	parts := make([]string, len(errs))
	for i, e := range errs {
		parts[i] = e.Error()
	}
	return strings.Join(parts, "; ")
}

// Description is what a function binary's --describe prints: enough for a
// tool (kfn dev) to prepare what the function needs.
type Description struct {
	Name    string   `json:"name"`
	Topic   string   `json:"topic,omitempty"`
	Subject string   `json:"subject,omitempty"`
	Stream  string   `json:"stream,omitempty"`
	Emits   []string `json:"emits,omitempty"`
}

// Describe returns fn's Description.
func Describe(fn kfn.Function) Description {
	d := Description{Name: fn.Name, Topic: fn.Topic, Subject: fn.Subject, Emits: fn.Emits}
	if fn.Subject != "" {
		d.Stream = fn.Stream
		if d.Stream == "" {
			d.Stream = engine.DefaultStream
		}
	}
	return d
}
