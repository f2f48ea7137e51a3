package process

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os/signal"
	"syscall"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/preflight"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/internal/settings"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// migrateMain is Main's migrate mode. It needs only --database-url: run it
// as the role that owns the schema (the migrator), once per deployment,
// and start the workers with --skip-setup under a role with DML rights only.
func migrateMain(fn kfn.Function, name string, args []string, stdout, stderr io.Writer) int {
	cmd := name + " " + preflight.MigrateCommand
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.SetOutput(stdout) // -h: the usage is what was asked for
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: %s %s --database-url URL\n\n"+
			"Applies kfn's schema migrations and the function's Setup, then exits; safe to run again.\n"+
			"Run it as the role that owns the schema, and the workers with --%s under a role with DML rights only.\n\n",
			name, preflight.MigrateCommand, settings.SkipSetup.Flag)
		settings.PrintDefaults(fs)
	}
	b := settings.NewBinder(fs)
	var dbURL string
	settings.DatabaseURL.Bind(b, &dbURL)
	if code, ok := parseArgs(fs, args, cmd, stderr); !ok {
		return code
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "%s: unexpected argument %q (see %s -h)\n", cmd, fs.Arg(0), cmd)
		return 2
	}
	if errs := b.Errors(); len(errs) > 0 {
		fmt.Fprintf(stderr, "%s: %s (see %s -h)\n", cmd, settingsLine(errs), cmd)
		return 2
	}
	if dbURL == "" {
		fmt.Fprintf(stderr, "%s: --%s is required (or set %s) (see %s -h)\n", cmd, settings.DatabaseURL.Flag, settings.DatabaseURL.Env, cmd)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	pool, err := connect.Postgres(ctx, dbURL, name+" "+preflight.MigrateCommand, nil)
	var urlErr *connect.URLError
	if errors.As(err, &urlErr) {
		fmt.Fprintf(stderr, "%s %s: %v\n", name, preflight.MigrateCommand, urlErr)
		return 2
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s %s: %v\n", name, preflight.MigrateCommand, err)
		return 1
	}
	defer pool.Close()
	applied, err := schema.MigrateReporting(ctx, pool, schema.PrintProgress(stdout, "kfn "))
	if err != nil {
		fmt.Fprintf(stderr, "%s %s: %v\n", name, preflight.MigrateCommand, err)
		return 1
	}
	fmt.Fprintf(stdout, "kfn %s\n", schema.Outcome(applied))
	if err := preflight.RunSetup(ctx, pool, []kfn.Function{fn}); err != nil {
		fmt.Fprintf(stderr, "%s %s: %v\n", name, preflight.MigrateCommand, err)
		return 1
	}
	if fn.Setup == nil {
		fmt.Fprintf(stdout, "function %s has no Setup\n", fn.Name)
	} else {
		fmt.Fprintf(stdout, "function %s: Setup applied\n", fn.Name)
	}
	return 0
}
