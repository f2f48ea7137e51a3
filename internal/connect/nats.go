package connect

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/kfn-dev/kfn/internal/authorlink"
	"github.com/kfn-dev/kfn/internal/redact"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// natsSecurity carries this package's methods on a runtime.NATSSecurity,
// the one definition of how kfn proves itself to NATS and checks the
// server, besides what the URL holds (user:pass@ or token@): at most one
// of a credentials file, an NKey seed file and a token file, and TLS with
// a CA file and an optional client certificate. Zero: what the URL says.
type natsSecurity runtime.NATSSecurity

// natsSetting is a setting of NATSSecurity, as messages name it.
type natsSetting struct{ flag, env string }

func (s natsSetting) String() string { return "--" + s.flag + " (" + s.env + ")" }

var (
	natsCredsSetting = natsSetting{"nats-creds", "KFN_NATS_CREDS"}
	natsNKeySetting  = natsSetting{"nats-nkey", "KFN_NATS_NKEY"}
	natsTokenSetting = natsSetting{"nats-token-file", "KFN_NATS_TOKEN_FILE"}
	natsCASetting    = natsSetting{"nats-ca", "KFN_NATS_CA"}
	natsCertSetting  = natsSetting{"nats-cert", "KFN_NATS_CERT"}
	natsKeySetting   = natsSetting{"nats-key", "KFN_NATS_KEY"}
)

// SettingError is a NATS security setting that cannot be used (a file
// that cannot be read, holds no certificate, or goes without its pair):
// the configuration, not the server, is at fault. It has the shape of the
// settings' errors: "invalid configuration: --flag (ENV): msg".
type SettingError struct {
	Flag string // without dashes
	Env  string
	Msg  string
}

func (e *SettingError) Error() string {
	return fmt.Sprintf("invalid configuration: --%s (%s): %s", e.Flag, e.Env, e.Msg)
}

func invalid(s natsSetting, format string, args ...any) error {
	return &SettingError{Flag: s.flag, Env: s.env, Msg: fmt.Sprintf(format, args...)}
}

// tls reports whether s asks for TLS.
func (s natsSecurity) tls() bool { return s.CAFile != "" || s.CertFile != "" || s.KeyFile != "" }

// BindNATSSecurity registers the NATS credential and TLS flags (and their
// variables) on b, for a worker, the relay and every kfn command that
// connects to NATS.
func BindNATSSecurity(b *settings.Binder, s *runtime.NATSSecurity) {
	authorlink.Get[runtime.Config, runtime.KafkaSecurity, runtime.NATSSecurity, runtime.Record, runtime.Event, runtime.Events, runtime.BatchEvents]().
		BindNATSSecurity(b, s)
}

// CheckNATS reads the files of s as a connection would, and returns what
// is wrong with them (a *SettingError), without connecting.
func CheckNATS(s runtime.NATSSecurity) error {
	_, err := natsSecurity(s).options()
	return err
}

// options reads the files of s (once) and returns the connection options.
// Its errors name the setting and never quote a file's content.
func (s natsSecurity) options() ([]nats.Option, error) {
	var given []natsSetting
	for _, g := range []struct {
		file    string
		setting natsSetting
	}{{s.Creds, natsCredsSetting}, {s.NKeyFile, natsNKeySetting}, {s.TokenFile, natsTokenSetting}} {
		if g.file != "" {
			given = append(given, g.setting)
		}
	}
	if len(given) > 1 {
		return nil, invalid(given[1], "is given with %s: give only one of --nats-creds, --nats-nkey and --nats-token-file", given[0])
	}
	var opts []nats.Option
	switch {
	case s.Creds != "":
		data, err := os.ReadFile(s.Creds)
		if err != nil {
			return nil, invalid(natsCredsSetting, "cannot read the credentials file: %v", err)
		}
		isCreds := strings.Contains(string(data), "BEGIN NATS USER JWT") && strings.Contains(string(data), "NKEY SEED")
		clear(data)
		if !isCreds {
			return nil, invalid(natsCredsSetting, "%s is not a NATS credentials file (a user JWT and its NKey seed, as nsc or nats-server's tools write them)", s.Creds)
		}
		opts = append(opts, nats.UserCredentials(s.Creds))
	case s.NKeyFile != "":
		opt, err := nats.NkeyOptionFromSeed(s.NKeyFile)
		if err != nil {
			return nil, invalid(natsNKeySetting, "cannot use %s as a user NKey seed file: %v", s.NKeyFile, err)
		}
		opts = append(opts, opt)
	case s.TokenFile != "":
		data, err := os.ReadFile(s.TokenFile)
		if err != nil {
			return nil, invalid(natsTokenSetting, "cannot read the token file: %v", err)
		}
		token := strings.TrimSpace(string(data))
		if token == "" {
			return nil, invalid(natsTokenSetting, "the token file %s is empty", s.TokenFile)
		}
		opts = append(opts, nats.Token(token))
	}
	if s.tls() {
		cfg, err := s.tlsConfig()
		if err != nil {
			return nil, err
		}
		opts = append(opts, nats.Secure(cfg))
	}
	return opts, nil
}

// tlsConfig is the TLS configuration of s; nats.go verifies the server's
// certificate against the host of the URL it dials.
func (s natsSecurity) tlsConfig() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if s.CAFile != "" {
		pem, err := os.ReadFile(s.CAFile)
		if err != nil {
			return nil, invalid(natsCASetting, "cannot read the CA file: %v", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, invalid(natsCASetting, "%s holds no PEM certificate", s.CAFile)
		}
		cfg.RootCAs = pool
	}
	switch {
	case s.CertFile != "" && s.KeyFile == "":
		return nil, invalid(natsKeySetting, "--nats-cert %s is given without its private key", s.CertFile)
	case s.KeyFile != "" && s.CertFile == "":
		return nil, invalid(natsCertSetting, "--nats-key %s is given without its certificate", s.KeyFile)
	case s.CertFile != "":
		cert, err := tls.LoadX509KeyPair(s.CertFile, s.KeyFile)
		if err != nil {
			return nil, invalid(natsCertSetting, "cannot load the client certificate %s with the key of --nats-key %s: %v", s.CertFile, s.KeyFile, err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// explain turns the error of a first connection to NATS at natsURL into
// one that names the setting to fix, with any secret of the URL hidden.
func (s natsSecurity) explain(err error, natsURL string) error {
	at := redact.Redact(natsURL)
	if errors.Is(err, nats.ErrNoServers) {
		// nats.go keeps the dial's error to itself: dial once more to
		// tell a refused connection from no answer.
		if dialErr := dialFirst(natsURL); dialErr != nil {
			err = fmt.Errorf("%w: %w", err, dialErr)
		}
	}
	msg := err.Error()
	var unknownCA x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var invalidCert x509.CertificateInvalidError
	var hint string
	switch {
	case errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrAuthRevoked) || errors.Is(err, nats.ErrAccountAuthExpired):
		switch {
		case s.Creds != "":
			hint = fmt.Sprintf("NATS at %s refused the user of %s %s: check that the file holds a user of the server's operator and account, and that it has not expired or been revoked", at, natsCredsSetting, s.Creds)
		case s.NKeyFile != "":
			hint = fmt.Sprintf("NATS at %s refused the NKey of %s %s: check that the server lists its public key", at, natsNKeySetting, s.NKeyFile)
		case s.TokenFile != "":
			hint = fmt.Sprintf("NATS at %s refused the token of %s %s", at, natsTokenSetting, s.TokenFile)
		case redact.HasSecret(natsURL):
			hint = fmt.Sprintf("NATS at %s refused %s of --nats-url (KFN_NATS_URL)", at, urlCredential(natsURL))
		default:
			hint = fmt.Sprintf("NATS at %s wants credentials: set %s to a .creds file (or %s, %s, or user:password in --nats-url)", at, natsCredsSetting, natsNKeySetting, natsTokenSetting)
		}
	case errors.As(err, &unknownCA) || strings.Contains(msg, "certificate signed by unknown authority"):
		if s.CAFile != "" {
			hint = fmt.Sprintf("the certificate of NATS at %s is not signed by a CA of %s %s: point it at the CA that signs the server's certificate", at, natsCASetting, s.CAFile)
		} else {
			hint = fmt.Sprintf("the certificate of NATS at %s is signed by an unknown authority: set %s to the PEM file of the CA that signs it", at, natsCASetting)
		}
	case errors.As(err, &hostname):
		hint = fmt.Sprintf("the certificate of NATS at %s is not valid for the host of --nats-url (KFN_NATS_URL): connect by a name the certificate holds", at)
	case errors.As(err, &invalidCert):
		hint = fmt.Sprintf("the certificate of NATS at %s is not valid: check %s", at, natsCASetting)
	case strings.Contains(msg, "certificate required") || strings.Contains(msg, "bad certificate"):
		hint = fmt.Sprintf("NATS at %s refused the TLS client certificate: set %s and %s to a certificate the server trusts", at, natsCertSetting, natsKeySetting)
	case errors.Is(err, nats.ErrSecureConnWanted):
		hint = fmt.Sprintf("NATS at %s does not offer TLS: drop %s, %s and %s, or enable TLS on the server", at, natsCASetting, natsCertSetting, natsKeySetting)
	case NATSCause(err) == CauseTLS:
		hint = fmt.Sprintf("TLS with NATS at %s failed: check %s, %s and %s, and whether the server wants TLS", at, natsCASetting, natsCertSetting, natsKeySetting)
	case NATSCause(err) == CauseRefused:
		hint = fmt.Sprintf("cannot reach NATS at %s: connection refused, nothing listens there (is it running? check the host and port of --nats-url (KFN_NATS_URL))", at)
	case NATSCause(err) == CauseUnreachable:
		hint = fmt.Sprintf("cannot reach NATS at %s: no answer (a timeout, no route or an unknown host: check the host and port of --nats-url (KFN_NATS_URL), and the network between)", at)
	default:
		return fmt.Errorf("cannot connect to NATS at %s (check --nats-url / KFN_NATS_URL): %w", at, scrub(err, natsURL))
	}
	return &scrubbed{msg: hint + ": " + redact.Scrub(msg, natsURL), err: err}
}

// dialFirst opens, and closes, a TCP connection to the first server of
// natsURL (a comma-separated list), and returns the dial's error.
func dialFirst(natsURL string) error {
	first, _, _ := strings.Cut(natsURL, ",")
	u, err := url.Parse(strings.TrimSpace(first))
	if err != nil || u.Host == "" {
		return nil
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "4222")
	}
	conn, err := net.DialTimeout("tcp", host, 3*time.Second)
	if err != nil {
		return err
	}
	conn.Close()
	return nil
}

// urlCredential names the credential a NATS URL holds: a user (with its
// password) by name, or a token.
func urlCredential(natsURL string) string {
	u, err := url.Parse(natsURL)
	if err != nil || u.User == nil {
		return "the credentials"
	}
	if _, hasPassword := u.User.Password(); hasPassword {
		return fmt.Sprintf("user %q (or its password)", u.User.Username())
	}
	return "the token"
}

// NATS connects to the NATS server at natsURL as name, reconnecting forever
// after a loss, and opens JetStream.
func NATS(natsURL, name string) (*nats.Conn, jetstream.JetStream, error) {
	return NATSWith(natsURL, name, runtime.NATSSecurity{})
}

// NATSWith is NATS with the credentials and TLS of sec.
func NATSWith(natsURL, name string, security runtime.NATSSecurity) (*nats.Conn, jetstream.JetStream, error) {
	sec := natsSecurity(security)
	opts, err := sec.options()
	if err != nil {
		return nil, nil, err
	}
	opts = append(opts, nats.Name(name), nats.Timeout(5*time.Second),
		nats.MaxReconnects(-1), nats.ReconnectWait(250*time.Millisecond))
	nc, err := nats.Connect(natsURL, opts...)
	if err != nil {
		return nil, nil, sec.explain(err, natsURL)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("NATS JetStream at %s: %w", redact.Redact(natsURL), scrub(err, natsURL))
	}
	return nc, js, nil
}
