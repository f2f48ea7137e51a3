// Package kafkaconn builds kfn's Kafka connections from the Kafka security
// settings (TLS and SASL), for the worker, the relay's users and every kfn
// command alike: one place that reads the CA, the client certificate and the
// SASL password, gets and refreshes the OAUTHBEARER tokens (tokens.go),
// takes a mechanism an opt-in module registered (package kafkaauth:
// AWS_MSK_IAM), and says in its errors which setting to fix.
package kafkaconn

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"

	"github.com/kfn-dev/kfn/internal/authorlink"
	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/kafkaauth"
	"github.com/kfn-dev/kfn/runtime"
)

// DialTimeout bounds one connection to a broker, TLS and SASL handshakes
// included.
const DialTimeout = 5 * time.Second

// security carries this package's methods on a runtime.KafkaSecurity, the
// one definition of the Kafka security settings (a worker's
// Config.KafkaSecurity, and every kfn command's --kafka-* flags).
type security runtime.KafkaSecurity

// BindSecurity registers the Kafka security flags (and their variables) on
// b, and reads the SASL password from KFN_KAFKA_SASL_PASSWORD, as
// runtime.Config.Bind does.
func BindSecurity(b *settings.Binder, s *runtime.KafkaSecurity) {
	authorlink.Get[runtime.Config, runtime.KafkaSecurity, runtime.NATSSecurity, runtime.Record, runtime.Event, runtime.Events, runtime.BatchEvents]().
		BindKafkaSecurity(b, s)
}

// Enabled reports whether s asks for TLS or SASL.
func Enabled(s runtime.KafkaSecurity) bool { return security(s).enabled() }

// Problems returns what is wrong with s: SASL without a user or a
// password, a certificate without its key, files that cannot be read. (The
// values given to BindSecurity that did not parse are the Binder's Errors.)
func Problems(s runtime.KafkaSecurity) []*Error { return security(s).problems() }

// Check returns Problems as one error (nil when there are none).
func Check(s runtime.KafkaSecurity) error { return security(s).check() }

// Env returns s as environment variables (NAME=value) for a child process,
// the password and the OAuth client secret included only as the files that
// hold them (one given in KFN_KAFKA_SASL_PASSWORD or
// KFN_KAFKA_OAUTH_CLIENT_SECRET reaches a child through its inherited
// environment).
func Env(s runtime.KafkaSecurity) []string { return security(s).env() }

func (s security) enabled() bool { return security(s).usesTLS() || s.SASLMechanism != "" }

func (s security) usesTLS() bool {
	return s.TLS || s.CAFile != "" || s.CertFile != "" || s.KeyFile != "" || s.ServerName != ""
}

// Error is a Kafka security setting that cannot be used. It has the shape
// of the settings' errors: "invalid configuration: --flag (ENV): msg".
type Error = settings.Error

func problem[T any](s settings.Setting[T], format string, args ...any) *Error {
	return &Error{Flag: s.Flag, Env: s.Env, Msg: fmt.Sprintf(format, args...)}
}

func (s security) problems() []*Error {
	var errs []*Error
	errs = append(errs, settings.KafkaSASLMechanism.Problems(s.SASLMechanism)...)
	errs = append(errs, settings.KafkaOAuthTokenURL.Problems(s.OAuthTokenURL)...)
	errs = append(errs, settings.KafkaOAuthExtensions.Problems(s.OAuthExtensions)...)
	userAndPassword := s.SASLUser != "" || s.SASLPasswordFile != ""
	switch s.SASLMechanism {
	case "":
		if userAndPassword {
			errs = append(errs, problem(settings.KafkaSASLMechanism, "not set, but a SASL user or password file is given: set it to PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512"))
		}
	case settings.SASLPlain, settings.SASLScramSHA256, settings.SASLScramSHA512:
		if s.SASLUser == "" {
			errs = append(errs, problem(settings.KafkaSASLUser, "--kafka-sasl-mechanism %s needs a user name", s.SASLMechanism))
		}
		if _, err := s.password(); err != nil {
			errs = append(errs, err)
		}
	case settings.SASLOAuthBearer:
		errs = append(errs, s.oauthProblems()...)
	case settings.SASLAWSMSKIAM:
		if _, ok := kafkaauth.Lookup(settings.SASLAWSMSKIAM); !ok {
			errs = append(errs, problem(settings.KafkaSASLMechanism, "AWS_MSK_IAM is not built into this binary: its main package must import github.com/kfn-dev/kfn/kafkaauth/mskiam (see docs/production/kafka.md)"))
		}
	}
	if (s.SASLMechanism == settings.SASLOAuthBearer || s.SASLMechanism == settings.SASLAWSMSKIAM) && userAndPassword {
		errs = append(errs, problem(settings.KafkaSASLUser, "a SASL user or password file is for PLAIN and SCRAM, not --kafka-sasl-mechanism %s: drop them", s.SASLMechanism))
	}
	if s.SASLMechanism != settings.SASLOAuthBearer && s.oauthGiven() {
		errs = append(errs, problem(settings.KafkaSASLMechanism, "--kafka-oauth-* settings are given, but the mechanism is %q: set it to OAUTHBEARER", s.SASLMechanism))
	}
	if s.CertFile != "" && s.KeyFile == "" {
		errs = append(errs, problem(settings.KafkaKey, "--kafka-cert %s is given without its private key", s.CertFile))
	}
	if s.KeyFile != "" && s.CertFile == "" {
		errs = append(errs, problem(settings.KafkaCert, "--kafka-key %s is given without its certificate", s.KeyFile))
	}
	if s.CAFile != "" {
		if _, err := s.caPool(); err != nil {
			errs = append(errs, err)
		}
	}
	if s.CertFile != "" && s.KeyFile != "" {
		if _, err := tls.LoadX509KeyPair(s.CertFile, s.KeyFile); err != nil {
			errs = append(errs, problem(settings.KafkaCert, "cannot load the client certificate %s with the key of --kafka-key %s: %v", s.CertFile, s.KeyFile, err))
		}
	}
	return errs
}

func (s security) check() error {
	var errs []error
	for _, e := range s.problems() {
		errs = append(errs, e)
	}
	return errors.Join(errs...)
}

func (s security) password() (string, *Error) {
	if s.SASLPasswordFile != "" {
		b, err := os.ReadFile(s.SASLPasswordFile)
		if err != nil {
			return "", problem(settings.KafkaSASLPasswordFile, "cannot read the SASL password: %v", err)
		}
		p := strings.TrimRight(string(b), "\r\n")
		if p == "" {
			return "", problem(settings.KafkaSASLPasswordFile, "%s is empty: it must hold the SASL password", s.SASLPasswordFile)
		}
		return p, nil
	}
	if s.SASLPassword == "" {
		return "", &Error{Flag: settings.KafkaSASLPasswordFile.Flag, Env: settings.KafkaSASLPasswordEnv + " or " + settings.KafkaSASLPasswordFile.Env,
			Msg: fmt.Sprintf("--kafka-sasl-mechanism %s needs a password: set %s, or name a file holding it", s.SASLMechanism, settings.KafkaSASLPasswordEnv)}
	}
	return s.SASLPassword, nil
}

func (s security) caPool() (*x509.CertPool, *Error) {
	b, err := os.ReadFile(s.CAFile)
	if err != nil {
		return nil, problem(settings.KafkaCA, "cannot read the CA file: %v", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, problem(settings.KafkaCA, "%s holds no PEM certificate", s.CAFile)
	}
	return pool, nil
}

// tlsConfig returns the TLS configuration of s, nil without TLS.
func (s security) tlsConfig() (*tls.Config, error) {
	if !security(s).usesTLS() {
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: s.ServerName}
	if s.CAFile != "" {
		pool, err := s.caPool()
		if err != nil {
			return nil, err
		}
		cfg.RootCAs = pool
	}
	if s.CertFile != "" || s.KeyFile != "" {
		if s.CertFile == "" || s.KeyFile == "" {
			return nil, s.check()
		}
		cert, err := tls.LoadX509KeyPair(s.CertFile, s.KeyFile)
		if err != nil {
			return nil, problem(settings.KafkaCert, "cannot load the client certificate %s with the key of --kafka-key %s: %v", s.CertFile, s.KeyFile, err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// mechanism returns the SASL mechanism of s, nil without SASL.
func (s security) mechanism() (sasl.Mechanism, error) {
	if s.SASLMechanism == "" {
		return nil, nil
	}
	if err := s.check(); err != nil {
		return nil, err
	}
	switch s.SASLMechanism {
	case settings.SASLOAuthBearer:
		return s.oauthBearer()
	case settings.SASLAWSMSKIAM:
		newMechanism, _ := kafkaauth.Lookup(settings.SASLAWSMSKIAM) // Check found it
		m, err := newMechanism(context.Background())
		if err != nil {
			return nil, problem(settings.KafkaSASLMechanism, "AWS_MSK_IAM: %v", err)
		}
		return m, nil
	}
	pass, perr := s.password()
	if perr != nil {
		return nil, perr
	}
	switch s.SASLMechanism {
	case settings.SASLPlain:
		return plain.Mechanism{Username: s.SASLUser, Password: pass}, nil
	case settings.SASLScramSHA256:
		return scram.Mechanism(scram.SHA256, s.SASLUser, pass)
	default: // SCRAM-SHA-512; Check rejects any other
		return scram.Mechanism(scram.SHA512, s.SASLUser, pass)
	}
}

// Kafka returns a transport (for kafka.Client and kafka.Writer) and a dialer
// (for kafka.Reader and kafka.Conn) that connect with s's TLS and SASL. The
// caller closes the transport's idle connections when done.
func Kafka(sec runtime.KafkaSecurity) (*kafka.Transport, *kafka.Dialer, error) {
	s := security(sec)
	if err := s.check(); err != nil {
		return nil, nil, err
	}
	tlsCfg, err := s.tlsConfig()
	if err != nil {
		return nil, nil, err
	}
	mech, err := s.mechanism()
	if err != nil {
		return nil, nil, err
	}
	transport := &kafka.Transport{DialTimeout: DialTimeout, IdleTimeout: 30 * time.Second, MetadataTTL: 5 * time.Second, TLS: tlsCfg, SASL: mech}
	dialer := &kafka.Dialer{Timeout: DialTimeout, DualStack: true, TLS: tlsCfg, SASLMechanism: mech}
	if m, ok := mech.(oauthBearer); ok {
		m.tokens.watch(transport) // new connections after each token refresh
	}
	return transport, dialer, nil
}

// Client returns a kafka.Client on brokers with s's TLS and SASL, and the
// function that closes its connections.
func Client(brokers []string, s runtime.KafkaSecurity) (*kafka.Client, func(), error) {
	transport, _, err := Kafka(s)
	if err != nil {
		return nil, nil, err
	}
	return &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second, Transport: transport}, transport.CloseIdleConnections, nil
}

// SecurityError is a first request to Kafka that failed for a reason of the
// security settings: the SASL login was refused or a certificate did not
// verify. Its message names the setting to fix.
type SecurityError struct {
	msg string
	err error
}

func (e *SecurityError) Error() string { return e.msg + ": " + e.err.Error() }
func (e *SecurityError) Unwrap() error { return e.err }

func securityError(err error, format string, args ...any) error {
	return &SecurityError{msg: fmt.Sprintf(format, args...), err: err}
}

// IsSecurity reports whether err holds a *SecurityError.
func IsSecurity(err error) bool {
	var se *SecurityError
	return errors.As(err, &se)
}

// Explain turns an error of a first request to Kafka at brokers into one
// that names the setting to fix, when it is a refused SASL login or a
// certificate that does not verify; other errors come back unchanged.
func Explain(err error, brokers []string, s runtime.KafkaSecurity) error {
	if err == nil {
		return nil
	}
	var se *SecurityError
	if errors.As(err, &se) {
		return se // the cause, without what the Kafka client put before it
	}
	at := strings.Join(brokers, ",")
	var unknownCA x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var invalid x509.CertificateInvalidError
	var recordHeader tls.RecordHeaderError
	msg := err.Error()
	if errors.Is(err, kafka.BrokerNotAvailable) && len(brokers) > 0 {
		// kafka-go's CreateTopics says only this of a broker it could not
		// dial: dial once more to say why.
		if conn, dialErr := net.DialTimeout("tcp", brokers[0], 3*time.Second); dialErr != nil {
			err = fmt.Errorf("%w: %w", err, dialErr)
		} else {
			conn.Close()
		}
	}
	switch {
	case (errors.Is(err, kafka.SASLAuthenticationFailed) || strings.Contains(msg, "SASL Authentication failed")) && s.SASLMechanism == settings.SASLOAuthBearer:
		return securityError(err, "Kafka at %s refused the OAUTHBEARER token from %s: check that the brokers trust its issuer and audience, and --kafka-oauth-scopes (%s)",
			at, security(s).oauthSource(), settings.KafkaOAuthScopes.Env)
	case (errors.Is(err, kafka.SASLAuthenticationFailed) || strings.Contains(msg, "SASL Authentication failed")) && s.SASLMechanism == settings.SASLAWSMSKIAM:
		return securityError(err, "Kafka at %s refused the AWS_MSK_IAM login: check the AWS credentials (AWS_PROFILE, AWS_ROLE_ARN, …), AWS_REGION and the role's kafka-cluster:Connect permission", at)
	case errors.Is(err, kafka.SASLAuthenticationFailed) || strings.Contains(msg, "SASL Authentication failed") || strings.Contains(msg, "Authentication failed during authentication"):
		return securityError(err, "Kafka at %s refused the SASL credentials of --kafka-sasl-user (%s) %q with --kafka-sasl-mechanism %s: check the user and the password (%s or --kafka-sasl-password-file)",
			at, settings.KafkaSASLUser.Env, s.SASLUser, s.SASLMechanism, settings.KafkaSASLPasswordEnv)
	case errors.Is(err, kafka.UnsupportedSASLMechanism) || errors.Is(err, kafka.IllegalSASLState):
		return securityError(err, "Kafka at %s does not accept --kafka-sasl-mechanism (%s) %s", at, settings.KafkaSASLMechanism.Env, s.SASLMechanism)
	case errors.As(err, &unknownCA) || strings.Contains(msg, "certificate signed by unknown authority"):
		return securityError(err, "the certificate of Kafka at %s is signed by an unknown authority: check --kafka-ca (%s) %q", at, settings.KafkaCA.Env, s.CAFile)
	case errors.As(err, &hostname):
		return securityError(err, "the certificate of Kafka at %s is not valid for the name the client verifies: set --kafka-server-name (%s) to a name it holds", at, settings.KafkaServerName.Env)
	case errors.As(err, &invalid):
		return securityError(err, "the certificate of Kafka at %s is not valid: check --kafka-ca (%s)", at, settings.KafkaCA.Env)
	case errors.As(err, &recordHeader) || strings.Contains(msg, "first record does not look like a TLS handshake"):
		return securityError(err, "Kafka at %s does not speak TLS: drop --kafka-tls (%s) and the other TLS settings, or use the brokers' TLS listener", at, settings.KafkaTLS.Env)
	case Cause(err) == connect.CauseRefused:
		return fmt.Errorf("cannot reach Kafka at %s: connection refused, nothing listens there (is it running? check --kafka-brokers (%s)): %w", at, settings.KafkaBrokers.Env, err)
	case Cause(err) == connect.CauseUnreachable:
		return fmt.Errorf("cannot reach Kafka at %s: no answer (a timeout, no route or an unknown host: check --kafka-brokers (%s), and the network between): %w", at, settings.KafkaBrokers.Env, err)
	case !security(s).usesTLS() && s.SASLMechanism == "" && (strings.Contains(msg, "EOF")):
		return fmt.Errorf("Kafka at %s closed the connection (if its listener uses TLS or SASL, set --kafka-tls (%s) and the SASL settings): %w", at, settings.KafkaTLS.Env, err)
	}
	return err
}

// Cause classifies the error of a first request to Kafka (see
// connect.Cause): a refused SASL login is CauseAuth, a mechanism the
// broker does not take too; TLS, refused and unreachable as
// connect.NetCause says.
func Cause(err error) connect.Cause {
	if err == nil {
		return connect.CauseOther
	}
	msg := err.Error()
	switch {
	case errors.Is(err, kafka.SASLAuthenticationFailed), strings.Contains(msg, "SASL Authentication failed"),
		strings.Contains(msg, "Authentication failed during authentication"),
		errors.Is(err, kafka.UnsupportedSASLMechanism), errors.Is(err, kafka.IllegalSASLState):
		return connect.CauseAuth
	case strings.Contains(msg, "first record does not look like a TLS handshake"):
		return connect.CauseTLS
	}
	return connect.NetCause(err)
}

func (s security) env() []string {
	var env []string
	add := func(name, v string) {
		if v != "" {
			env = append(env, name+"="+v)
		}
	}
	if s.TLS {
		add(settings.KafkaTLS.Env, "true")
	}
	add(settings.KafkaCA.Env, s.CAFile)
	add(settings.KafkaCert.Env, s.CertFile)
	add(settings.KafkaKey.Env, s.KeyFile)
	add(settings.KafkaServerName.Env, s.ServerName)
	add(settings.KafkaSASLMechanism.Env, s.SASLMechanism)
	add(settings.KafkaSASLUser.Env, s.SASLUser)
	add(settings.KafkaSASLPasswordFile.Env, s.SASLPasswordFile)
	add(settings.KafkaOAuthTokenURL.Env, s.OAuthTokenURL)
	add(settings.KafkaOAuthClientID.Env, s.OAuthClientID)
	add(settings.KafkaOAuthClientSecretFile.Env, s.OAuthClientSecretFile)
	add(settings.KafkaOAuthScopes.Env, strings.Join(s.OAuthScopes, ","))
	add(settings.KafkaOAuthTokenFile.Env, s.OAuthTokenFile)
	add(settings.KafkaOAuthExtensions.Env, strings.Join(s.OAuthExtensions, ","))
	return env
}
