package connect

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
)

// Cause is why a first connection to a service failed, in the kinds an
// operator fixes differently. Each service has its classifier
// (PostgresCause, NATSCause, kafkaconn.Cause) over the transport's
// NetCause, and each cause its own message.
type Cause int

const (
	// CauseOther is none of the below: the error is shown as it is.
	CauseOther Cause = iota
	// CauseUnreachable: no answer. A timeout, no route to the host, a
	// host name that does not resolve.
	CauseUnreachable
	// CauseRefused: the host answered that nothing listens on the port.
	CauseRefused
	// CauseTLS: the TLS handshake or the verification of a certificate
	// failed, or one side wants TLS and the other does not offer it.
	CauseTLS
	// CauseAuth: the server refused the credentials (password, token,
	// user, SASL login).
	CauseAuth
)

func (c Cause) String() string {
	switch c {
	case CauseUnreachable:
		return "unreachable"
	case CauseRefused:
		return "refused"
	case CauseTLS:
		return "tls"
	case CauseAuth:
		return "auth"
	}
	return "other"
}

// NetCause classifies the transport part of err, common to every service:
// refused, unreachable or TLS; CauseOther otherwise.
func NetCause(err error) Cause {
	var dns *net.DNSError
	var netErr net.Error
	var recordHeader tls.RecordHeaderError
	var verify *tls.CertificateVerificationError
	var unknownCA x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var invalid x509.CertificateInvalidError
	var alert tls.AlertError
	switch {
	case err == nil:
		return CauseOther
	case errors.As(err, &recordHeader), errors.As(err, &verify), errors.As(err, &unknownCA),
		errors.As(err, &hostname), errors.As(err, &invalid), errors.As(err, &alert):
		return CauseTLS
	case errors.Is(err, syscall.ECONNREFUSED):
		return CauseRefused
	case errors.As(err, &dns), errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH),
		errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded),
		errors.As(err, &netErr) && netErr.Timeout():
		return CauseUnreachable
	}
	msg := err.Error()
	switch {
	case strings.Contains(msg, "tls: "), strings.Contains(msg, "x509: "):
		return CauseTLS
	case strings.Contains(msg, "connection refused"):
		return CauseRefused
	case strings.Contains(msg, "i/o timeout"), strings.Contains(msg, "no route to host"), strings.Contains(msg, "network is unreachable"):
		return CauseUnreachable
	}
	return CauseOther
}

// PostgresCause classifies the error of a first connection to Postgres.
// The server refusing a user or a password is CauseAuth (SQLSTATE 28P01
// invalid_password, 28000 invalid_authorization_specification), except
// when pg_hba.conf wants TLS the client did not use ("no encryption"):
// that is CauseTLS, as is a server that refuses TLS the client requires.
func PostgresCause(err error) Cause {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case pgErr.Code == "28000" && (strings.Contains(pgErr.Message, "no encryption") || strings.Contains(pgErr.Message, "SSL off")):
			return CauseTLS
		case pgErr.Code == "28P01" || pgErr.Code == "28000":
			return CauseAuth
		}
		return CauseOther
	}
	if err != nil && strings.Contains(err.Error(), "server refused TLS connection") {
		return CauseTLS
	}
	return NetCause(err)
}

// NATSCause classifies the error of a first connection to NATS.
func NATSCause(err error) Cause {
	switch {
	case errors.Is(err, nats.ErrAuthorization), errors.Is(err, nats.ErrAuthExpired),
		errors.Is(err, nats.ErrAuthRevoked), errors.Is(err, nats.ErrAccountAuthExpired):
		return CauseAuth
	case errors.Is(err, nats.ErrSecureConnWanted), errors.Is(err, nats.ErrSecureConnRequired):
		return CauseTLS
	}
	if err != nil && strings.Contains(err.Error(), "authorization violation") {
		return CauseAuth
	}
	if c := NetCause(err); c != CauseOther {
		return c
	}
	if errors.Is(err, nats.ErrNoServers) || errors.Is(err, nats.ErrTimeout) {
		return CauseUnreachable
	}
	return CauseOther
}
