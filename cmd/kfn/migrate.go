package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/runtime/schema"
)

func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("migrate", stderr)
	fs.describe("usage: kfn migrate --database-url URL\n\nApplies kfn's embedded, numbered schema migrations; safe to run again (it says the schema is up to date). Workers refuse to start on a missing schema, an older one, or a newer one whose migrations break them (a migration is additive or says which older workers it breaks); the output names the oldest worker version that runs against the result.",
		"kfn migrate --database-url postgres://kfn@db:5432/kfn",
		"DATABASE_URL=postgres://kfn@db:5432/kfn kfn migrate")
	dbURL := bind(fs, settings.DatabaseURL)
	if err := parse(fs, args); err != nil {
		return err
	}
	pool, err := openDatabase(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	applied, err := schema.Migrate(ctx, pool)
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, schema.Outcome(applied))
	return nil
}

// appName is the application_name of the Postgres sessions of the running
// command: "kfn <command>" (run sets it).
var appName = "kfn"

// openDatabase is connectPostgres for a command that needs
// --database-url: without it, a usage error naming the variable too.
func openDatabase(ctx context.Context, dbURL string) (*pgxpool.Pool, error) {
	if err := requiredSetting(settings.DatabaseURL, dbURL); err != nil {
		return nil, err
	}
	return connectPostgres(ctx, dbURL)
}

// connectPostgres opens a pool and checks that the server answers; a URL
// that does not parse is a usage error.
func connectPostgres(ctx context.Context, dbURL string) (*pgxpool.Pool, error) {
	pool, err := connect.Postgres(ctx, dbURL, appName, nil)
	var urlErr *connect.URLError
	if errors.As(err, &urlErr) {
		return nil, &usageError{msg: urlErr.Error()}
	}
	return pool, err
}
