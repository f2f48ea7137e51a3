// Package redact hides the secrets of connection settings (passwords and
// tokens in Postgres and NATS URLs and keyword/value connection strings)
// in what kfn prints: Redact for a setting shown as a value, Scrub for a
// message from a library that may quote it. Package settings, package
// connect and the kfn commands use it. It is not a stable API.
package redact

import (
	"net/url"
	"strings"
)

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
