// Package connect opens kfn's connections to Postgres and NATS, for the
// worker, the relay and every kfn command alike: one place that parses
// the URLs, checks that the service answers, and says in its errors which
// setting to fix (naming the flag and the environment variable), with any
// password in a URL hidden.
package connect

import (
	"context"
	"fmt"
	"net/url"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// pingTimeout bounds the first round trip to a service.
const pingTimeout = 10 * time.Second

// URLError is a URL that does not parse: the caller's configuration, not
// the service, is at fault.
type URLError struct {
	Setting string // e.g. "--database-url (DATABASE_URL)"
	URL     string // redacted
	Err     error
}

func (e *URLError) Error() string { return fmt.Sprintf("%s %s: %v", e.Setting, e.URL, e.Err) }
func (e *URLError) Unwrap() error { return e.Err }

// Postgres opens a pool on databaseURL, lets configure adjust its settings
// (nil: none), and checks that the server answers.
func Postgres(ctx context.Context, databaseURL string, configure func(*pgxpool.Config)) (*pgxpool.Pool, error) {
	const setting = "--database-url (DATABASE_URL)"
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, &URLError{Setting: setting, URL: Redact(databaseURL), Err: err}
	}
	if configure != nil {
		configure(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to Postgres: %w", err)
	}
	pingCtx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("cannot reach Postgres at %s (is it running? check %s): %w", Redact(databaseURL), setting, err)
	}
	return pool, nil
}

// NATS connects to the NATS server at natsURL as name, reconnecting forever
// after a loss, and opens JetStream.
func NATS(natsURL, name string) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := nats.Connect(natsURL, nats.Name(name), nats.Timeout(5*time.Second),
		nats.MaxReconnects(-1), nats.ReconnectWait(250*time.Millisecond))
	if err != nil {
		return nil, nil, fmt.Errorf("cannot reach NATS at %s (check --nats-url / KFN_NATS_URL): %w", Redact(natsURL), err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("NATS JetStream at %s: %w", Redact(natsURL), err)
	}
	return nc, js, nil
}

// Redact hides a password in a URL before it is printed.
func Redact(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "<unparseable URL>"
	}
	return u.Redacted()
}
