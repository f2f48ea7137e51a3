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
		return nil, &URLError{Setting: setting, URL: Redact(databaseURL), Err: parseProblem(err, databaseURL)}
	}
	if appName != "" && cfg.ConnConfig.RuntimeParams["application_name"] == "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = appName
	}
	if configure != nil {
		configure(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to Postgres at %s: %w", Redact(databaseURL), scrub(err, databaseURL))
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
	at := Redact(databaseURL)
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
	return errors.New(Scrub(msg, connString))
}

// Scrub replaces in msg every secret that connString holds (see Redact),
// for a message from a library that may quote it.
func Scrub(msg, connString string) string {
	for _, secret := range secrets(connString) {
		if len(secret) >= 3 || strings.Contains(msg, "@"+secret) || strings.Contains(msg, ":"+secret+"@") {
			msg = strings.ReplaceAll(msg, secret, mask)
		}
	}
	return msg
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
	return &scrubbed{msg: Scrub(err.Error(), connString), err: err}
}

// dsnPairs splits a keyword/value connection string into its keys and
// their values, unquoted and as written.
func dsnPairs(s string) [][3]string {
	var out [][3]string
	i := 0
	for i < len(s) {
		for i < len(s) && isSpace(s[i]) {
			i++
		}
		start := i
		for i < len(s) && s[i] != '=' && !isSpace(s[i]) {
			i++
		}
		key := s[start:i]
		for i < len(s) && isSpace(s[i]) {
			i++
		}
		if i >= len(s) || s[i] != '=' {
			continue
		}
		i++
		for i < len(s) && isSpace(s[i]) {
			i++
		}
		var v strings.Builder
		vstart := i
		if i < len(s) && s[i] == '\'' {
			i++
			for i < len(s) && s[i] != '\'' {
				if s[i] == '\\' && i+1 < len(s) {
					i++
				}
				v.WriteByte(s[i])
				i++
			}
			i++
		} else {
			for i < len(s) && !isSpace(s[i]) {
				if s[i] == '\\' && i+1 < len(s) {
					i++
				}
				v.WriteByte(s[i])
				i++
			}
		}
		out = append(out, [3]string{key, v.String(), s[vstart:min(i, len(s))]})
	}
	return out
}

// secrets returns the secrets of a connection setting, as written and
// decoded.
func secrets(s string) []string {
	var out []string
	add := func(v string) {
		if v == "" || v == mask {
			return
		}
		out = append(out, v)
		if d, err := url.PathUnescape(v); err == nil && d != v {
			out = append(out, d)
		}
	}
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		if i := strings.Index(p, "://"); i >= 0 {
			rest := p[i+3:]
			if j := strings.IndexAny(rest, "/?#"); j >= 0 {
				rest = rest[:j]
			}
			if at := strings.LastIndex(rest, "@"); at >= 0 {
				userinfo := rest[:at]
				if c := strings.Index(userinfo, ":"); c >= 0 {
					add(userinfo[c+1:])
				} else if !strings.HasPrefix(p, "postgres") {
					add(userinfo)
				}
			}
			if q := strings.Index(p, "?"); q >= 0 {
				if vals, err := url.ParseQuery(p[q+1:]); err == nil {
					for k, vs := range vals {
						if secretKey(k) {
							for _, v := range vs {
								add(v)
							}
						}
					}
				}
			}
		}
	}
	if !strings.Contains(s, "://") {
		for _, kv := range dsnPairs(s) {
			if secretKey(kv[0]) {
				add(kv[1])
				add(kv[2])
			}
		}
		if !strings.Contains(s, "=") {
			if at := strings.LastIndex(s, "@"); at >= 0 {
				add(s[:at])
			}
		}
	}
	return out
}

// mask replaces a secret.
const mask = "xxxxx"

// Redact hides the secrets in a connection setting before it is printed:
// the password of a URL (postgres://user:pass@…, nats://user:pass@…), the
// token of a NATS URL (nats://token@…: a user without a password, in any
// URL but a postgres:// one), password and sslpassword query parameters,
// and the password and sslpassword of a keyword/value connection string
// (host=… password='…'). It handles a comma-separated list of URLs, as
// NATS takes. A URL that does not parse is replaced whole.
func Redact(s string) string {
	if !strings.Contains(s, "://") {
		return redactDSN(s)
	}
	parts := strings.Split(s, ",")
	for i, p := range parts {
		parts[i] = redactURL(p)
	}
	return strings.Join(parts, ",")
}

func redactURL(s string) string {
	trimmed := strings.TrimSpace(s)
	if trimmed == "" {
		return s
	}
	u, err := url.Parse(trimmed)
	if err != nil {
		// Mask what secrets() finds by itself; if any text is left that
		// could be one, give up on the URL.
		masked := Scrub(trimmed, trimmed)
		if i := strings.Index(masked, "://"); i >= 0 {
			userinfo := masked[i+3:]
			if j := strings.IndexAny(userinfo, "/?#"); j >= 0 {
				userinfo = userinfo[:j]
			}
			if at := strings.LastIndex(userinfo, "@"); at < 0 || strings.HasSuffix(userinfo[:at], mask) {
				if !strings.Contains(masked, "?") {
					return masked
				}
			}
		}
		return "<unparseable URL>"
	}
	postgres := u.Scheme == "postgres" || u.Scheme == "postgresql"
	if u.User != nil {
		if _, has := u.User.Password(); has {
			u.User = url.UserPassword(u.User.Username(), mask)
		} else if !postgres && u.User.Username() != "" {
			u.User = url.User(mask) // a NATS token
		}
	}
	if u.RawQuery != "" {
		q, err := url.ParseQuery(u.RawQuery)
		if err != nil {
			u.RawQuery = mask
		} else {
			changed := false
			for k := range q {
				if secretKey(k) {
					q[k] = []string{mask}
					changed = true
				}
			}
			if changed {
				u.RawQuery = q.Encode()
			}
		}
	}
	return u.String()
}

// secretKey reports whether a connection parameter holds a secret.
func secretKey(k string) bool {
	switch strings.ToLower(k) {
	case "password", "sslpassword", "token", "pass":
		return true
	}
	return false
}

// redactDSN masks the secrets of a keyword/value connection string
// (key=value pairs separated by spaces; a value may be single-quoted with
// backslash escapes). Anything that is not such a string but holds an @
// (a NATS address token@host:port without a scheme) loses what precedes
// the @; a string that is neither is returned as it is (host:port).
func redactDSN(s string) string {
	if !strings.Contains(s, "=") {
		if i := strings.LastIndex(s, "@"); i >= 0 {
			return mask + s[i:]
		}
		return s
	}
	var b strings.Builder
	i := 0
	for i < len(s) {
		// spaces
		for i < len(s) && isSpace(s[i]) {
			b.WriteByte(s[i])
			i++
		}
		if i >= len(s) {
			break
		}
		// key
		start := i
		for i < len(s) && s[i] != '=' && !isSpace(s[i]) {
			i++
		}
		key := s[start:i]
		b.WriteString(key)
		for i < len(s) && isSpace(s[i]) {
			b.WriteByte(s[i])
			i++
		}
		if i >= len(s) || s[i] != '=' {
			if strings.Contains(strings.ToLower(s[i:]), "password") {
				b.WriteString(" <unparseable connection string>")
				return b.String()
			}
			continue
		}
		b.WriteByte('=')
		i++
		for i < len(s) && isSpace(s[i]) {
			b.WriteByte(s[i])
			i++
		}
		// value
		vstart := i
		if i < len(s) && s[i] == '\'' {
			i++
			for i < len(s) && s[i] != '\'' {
				if s[i] == '\\' {
					i++
				}
				i++
			}
			i++ // the closing quote
			if i > len(s) {
				i = len(s)
			}
		} else {
			for i < len(s) && !isSpace(s[i]) {
				if s[i] == '\\' {
					i++
				}
				i++
			}
			if i > len(s) {
				i = len(s)
			}
		}
		if secretKey(key) {
			b.WriteString(mask)
		} else {
			b.WriteString(s[vstart:i])
		}
	}
	return b.String()
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}

// HasSecret reports whether a connection setting holds a password or a
// token (what Redact hides).
func HasSecret(s string) bool { return len(secrets(s)) > 0 }
