package main

import (
	"context"
	"fmt"
	"io"
	"net/url"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/runtime/schema"
)

func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("migrate", stderr)
	dbURL := bind(fs, settings.DatabaseURL)
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := requiredSetting(settings.DatabaseURL, *dbURL); err != nil {
		return err
	}
	pool, err := connectPostgres(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	applied, err := schema.Migrate(ctx, pool)
	if err != nil {
		return err
	}
	if len(applied) == 0 {
		fmt.Fprintf(stdout, "schema is up to date at version %d\n", schema.Latest())
		return nil
	}
	fmt.Fprintf(stdout, "applied migrations %v; schema is at version %d\n", applied, schema.Latest())
	return nil
}

// connectPostgres opens a pool and checks that the server answers.
func connectPostgres(ctx context.Context, dbURL string) (*pgxpool.Pool, error) {
	redacted := "<unparseable URL>"
	if u, err := url.Parse(dbURL); err == nil {
		redacted = u.Redacted()
	}
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return nil, &usageError{msg: fmt.Sprintf("--database-url %s: %v", redacted, err)}
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("cannot reach Postgres at %s (is it running? check --database-url): %w", redacted, err)
	}
	return pool, nil
}
