// Package connect opens kfn's connections to Postgres and NATS, for the
// worker, the relay and every kfn command alike: one place that parses
// the URLs, checks that the service answers, and says in its errors which
// setting to fix (naming the flag and the environment variable), with any
// password in a URL hidden.
package connect

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/kfn-dev/kfn/internal/redact"
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

// Postgres opens a pool on databaseURL (a postgres:// URL or a keyword/value
// connection string), lets configure adjust its settings (nil: none), and
// checks that the server answers. Its sessions set application_name to
// appName unless databaseURL sets it.
func Postgres(ctx context.Context, databaseURL, appName string, configure func(*pgxpool.Config)) (*pgxpool.Pool, error) {
	const setting = "--database-url (DATABASE_URL)"
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		// pgconn's parse errors quote the string with the password masked
		// on a best-effort basis; say only what is wrong, not the string.
		return nil, &URLError{Setting: setting, URL: redact.Redact(databaseURL), Err: parseProblem(err, databaseURL)}
	}
	if appName != "" && cfg.ConnConfig.RuntimeParams["application_name"] == "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = appName
	}
	if configure != nil {
		configure(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to Postgres at %s: %w", redact.Redact(databaseURL), scrub(err, databaseURL))
	}
	pingCtx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		return nil, explainPostgres(err, databaseURL, cfg.ConnConfig.User, fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	}
	return pool, nil
}

// explainPostgres says why the first connection to Postgres failed, one
// message per Cause, naming the setting to fix; for a refused login, the
// user and the server.
func explainPostgres(err error, databaseURL, user, server string) error {
	const setting = "--database-url (DATABASE_URL)"
	at := redact.Redact(databaseURL)
	var format string
	switch PostgresCause(err) {
	case CauseAuth:
		return fmt.Errorf("Postgres at %s refused user %q: wrong password, or no such user or database for it (check %s and the server's pg_hba.conf): %w", server, user, setting, scrub(err, databaseURL))
	case CauseTLS:
		switch {
		case untrustedCertificate(err):
			format = "the certificate of Postgres at %s does not verify: check sslrootcert (the CA that signs the server's certificate) and the host name in %s: %w"
		case strings.Contains(err.Error(), "server refused TLS connection"):
			format = "Postgres at %s does not offer TLS: lower sslmode in %s, or turn ssl on in the server: %w"
		default:
			format = "TLS with Postgres at %s failed: check sslmode, sslrootcert, sslcert and sslkey in %s: %w"
		}
	case CauseRefused:
		format = "cannot reach Postgres at %s: connection refused, nothing listens there (is it running? check the host and port in %s): %w"
	case CauseUnreachable:
		format = "cannot reach Postgres at %s: no answer (a timeout, no route or an unknown host: check the host and port in %s, and the network between): %w"
	default:
		format = "cannot connect to Postgres at %s (check %s): %w"
	}
	return fmt.Errorf(format, at, setting, scrub(err, databaseURL))
}

// untrustedCertificate reports whether err is a server certificate that
// TLS verification refused (sslmode=verify-ca or verify-full): an unknown
// authority, a name it was not issued for, or one that is invalid.
func untrustedCertificate(err error) bool {
	var verify *tls.CertificateVerificationError
	var unknown x509.UnknownAuthorityError
	var host x509.HostnameError
	var invalid x509.CertificateInvalidError
	return errors.As(err, &verify) || errors.As(err, &unknown) || errors.As(err, &host) || errors.As(err, &invalid)
}

// parseProblem is what pgx found wrong in connString, without the string:
// pgconn.ParseConfigError quotes it (masked on a best-effort basis), and a
// *url.Error inside it quotes it whole.
func parseProblem(err error, connString string) error {
	msg := err.Error()
	var ue *url.Error
	if errors.As(err, &ue) {
		msg = strings.ReplaceAll(msg, ue.Error(), ue.Err.Error())
	}
	if strings.HasPrefix(msg, "cannot parse `") {
		if i := strings.Index(msg, "`: "); i >= 0 {
			msg = msg[i+3:]
		}
	}
	return errors.New(redact.Scrub(msg, connString))
}

// scrubbed is an error whose message has its secrets replaced; it still
// unwraps to the original.
type scrubbed struct {
	msg string
	err error
}

func (e *scrubbed) Error() string { return e.msg }
func (e *scrubbed) Unwrap() error { return e.err }

func scrub(err error, connString string) error {
	return &scrubbed{msg: redact.Scrub(err.Error(), connString), err: err}
}
