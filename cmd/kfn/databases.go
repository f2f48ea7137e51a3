package main

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/settings"
)

// databaseFlags say where the functions keep their kfn tables (cursors,
// inbox, dead letters, outbox): --database-url, unless --function-databases
// names a database of the function's own. Functions are joined only by
// NATS, so each one (or each group) may have its own Postgres; an operator
// command works on one function's database, or, asked about every
// function, on each database in turn.
type databaseFlags struct {
	url       *string
	functions *[]string // FUNCTION=URL, checked by the setting
}

func bindDatabases(fs *flagSet) databaseFlags {
	return databaseFlags{url: bind(fs, settings.DatabaseURL), functions: bind(fs, settings.FunctionDatabases)}
}

// of is function's database: its own, else --database-url's (a usage error
// when neither is given). Function "" is --database-url's.
func (d databaseFlags) of(function string) (string, error) {
	if url, ok := d.own()[function]; ok && function != "" {
		return url, nil
	}
	if strings.TrimSpace(*d.url) != "" {
		return *d.url, nil
	}
	if function != "" && len(*d.functions) > 0 {
		return "", &usageError{msg: fmt.Sprintf("function %q is not in --%s: give its database there, or --%s (or set %s)",
			function, settings.FunctionDatabases.Flag, settings.DatabaseURL.Flag, settings.DatabaseURL.Env)}
	}
	return "", requiredSetting(settings.DatabaseURL, "")
}

// own is the database URL of each function that has one of its own.
func (d databaseFlags) own() map[string]string {
	urls := make(map[string]string, len(*d.functions))
	for _, item := range *d.functions {
		name, url, _ := strings.Cut(item, "=")
		urls[strings.TrimSpace(name)] = strings.TrimSpace(url)
	}
	return urls
}

// all is every database: --database-url's, if given, then each function's
// own, each once.
func (d databaseFlags) all() ([]string, error) {
	var urls []string
	if strings.TrimSpace(*d.url) != "" {
		urls = append(urls, *d.url)
	}
	for _, item := range *d.functions {
		_, url, _ := strings.Cut(item, "=")
		if url = strings.TrimSpace(url); !slices.Contains(urls, url) {
			urls = append(urls, url)
		}
	}
	if len(urls) == 0 {
		return nil, requiredSetting(settings.DatabaseURL, "")
	}
	return urls, nil
}

// open connects to function's database ("": --database-url's).
func (d databaseFlags) open(ctx context.Context, function string) (*pgxpool.Pool, error) {
	url, err := d.of(function)
	if err != nil {
		return nil, err
	}
	return connectPostgres(ctx, url)
}

// urls is function's database, or every database when function is "".
func (d databaseFlags) urls(function string) ([]string, error) {
	if function == "" {
		return d.all()
	}
	url, err := d.of(function)
	return []string{url}, err
}

// eachDatabase connects to the database of function, or to every database
// when function is "", and calls f with each pool in turn.
func (d databaseFlags) eachDatabase(ctx context.Context, function string, f func(*pgxpool.Pool) error) error {
	urls, err := d.urls(function)
	if err != nil {
		return err
	}
	for _, url := range urls {
		pool, err := connectPostgres(ctx, url)
		if err != nil {
			return err
		}
		err = f(pool)
		pool.Close()
		if err != nil {
			return err
		}
	}
	return nil
}

// connectAll connects to each of urls, in order. closeAll closes the
// pools it made, after an error too.
func connectAll(ctx context.Context, urls []string) (pools []*pgxpool.Pool, closeAll func(), err error) {
	closeAll = func() {
		for _, p := range pools {
			p.Close()
		}
	}
	for _, url := range urls {
		pool, err := connectPostgres(ctx, url)
		if err != nil {
			return pools, closeAll, err
		}
		pools = append(pools, pool)
	}
	return pools, closeAll, nil
}
