package kafkaconn

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"

	"github.com/kfn-dev/kfn/internal/settings"
)

// oauthBearer is the SASL mechanism OAUTHBEARER (RFC 7628) for kafka-go,
// which has none of its own. kafka-go authenticates each connection it
// opens once, when it opens it (Start), and never again: the token a
// connection logged in with is never refreshed on that connection. A
// broker with connections.max.reauth.ms set closes such a connection at
// the first request after its token expired, before it handles it (that
// request is not applied, so nothing is lost or done twice); kfn's readers
// then open a new connection, which logs in with the token the source has
// refreshed by then (tokenSource). Without connections.max.reauth.ms the
// broker keeps an authenticated connection open past the token's expiry.
type oauthBearer struct {
	tokens     *tokenSource
	extensions []string // key=value, checked by settings.KafkaOAuthExtensions
}

func (m oauthBearer) Name() string { return "OAUTHBEARER" }

// Start sends the client's first message: the GS2 header without an
// authorization identity, the token and the extensions, each ended by
// 0x01, and a final 0x01.
func (m oauthBearer) Start(ctx context.Context) (sasl.StateMachine, []byte, error) {
	tok, err := m.tokens.Token(ctx)
	if err != nil {
		return nil, nil, err
	}
	return m, initialResponse(tok, m.extensions), nil
}

func initialResponse(token string, extensions []string) []byte {
	var b strings.Builder
	b.WriteString("n,,\x01auth=Bearer ")
	b.WriteString(token)
	b.WriteByte(1)
	for _, kv := range extensions {
		b.WriteString(kv)
		b.WriteByte(1)
	}
	b.WriteByte(1)
	return []byte(b.String())
}

// Next ends the exchange: an empty answer is success. A broker that
// refuses the token answers with a JSON error (RFC 7628 section 3.2.2),
// which ends the login here, with the broker's reason.
func (m oauthBearer) Next(_ context.Context, challenge []byte) (bool, []byte, error) {
	if len(challenge) == 0 {
		return true, nil, nil
	}
	return false, nil, fmt.Errorf("%w: the broker refused the OAUTHBEARER token: %s", kafka.SASLAuthenticationFailed, challenge)
}

// oauthGiven reports whether any OAUTHBEARER setting is given.
func (s security) oauthGiven() bool {
	return s.OAuthTokenURL != "" || s.OAuthClientID != "" || s.OAuthClientSecretFile != "" || s.OAuthClientSecret != "" ||
		len(s.OAuthScopes) > 0 || s.OAuthTokenFile != "" || len(s.OAuthExtensions) > 0
}

// oauthSource says where s's OAUTHBEARER tokens come from.
func (s security) oauthSource() string {
	if s.OAuthTokenFile != "" {
		return fmt.Sprintf("--kafka-oauth-token-file (%s) %s", settings.KafkaOAuthTokenFile.Env, s.OAuthTokenFile)
	}
	return fmt.Sprintf("--kafka-oauth-token-url (%s) %s", settings.KafkaOAuthTokenURL.Env, s.OAuthTokenURL)
}

// oauthProblems returns what is wrong with s's OAUTHBEARER settings:
// neither or both of a token URL and a token file, a token URL without a
// client id or secret, files that cannot be read.
func (s security) oauthProblems() []*Error {
	var errs []*Error
	switch {
	case s.OAuthTokenURL == "" && s.OAuthTokenFile == "":
		errs = append(errs, problem(settings.KafkaOAuthTokenURL, "--kafka-sasl-mechanism OAUTHBEARER needs a token: set the token endpoint (with --kafka-oauth-client-id and %s), or --kafka-oauth-token-file", settings.KafkaOAuthClientSecretEnv))
	case s.OAuthTokenURL != "" && s.OAuthTokenFile != "":
		errs = append(errs, problem(settings.KafkaOAuthTokenFile, "give either a token file or --kafka-oauth-token-url %s, not both", s.OAuthTokenURL))
	case s.OAuthTokenFile != "":
		if s.OAuthClientID != "" || s.OAuthClientSecretFile != "" || len(s.OAuthScopes) > 0 {
			errs = append(errs, problem(settings.KafkaOAuthTokenFile, "a token file takes no client id, client secret or scopes (those are for --kafka-oauth-token-url)"))
		}
		if _, err := os.Stat(s.OAuthTokenFile); err != nil {
			errs = append(errs, problem(settings.KafkaOAuthTokenFile, "cannot read the OAUTHBEARER token: %v", err))
		}
	default:
		if s.OAuthClientID == "" {
			errs = append(errs, problem(settings.KafkaOAuthClientID, "--kafka-oauth-token-url needs the OAuth client id"))
		}
		if _, err := s.clientSecret(); err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}

// clientSecret returns the OAuth client secret, from its file if one is
// named.
func (s security) clientSecret() (string, *Error) {
	if s.OAuthClientSecretFile != "" {
		b, err := os.ReadFile(s.OAuthClientSecretFile)
		if err != nil {
			return "", problem(settings.KafkaOAuthClientSecretFile, "cannot read the OAuth client secret: %v", err)
		}
		secret := strings.TrimRight(string(b), "\r\n")
		if secret == "" {
			return "", problem(settings.KafkaOAuthClientSecretFile, "%s is empty: it must hold the OAuth client secret", s.OAuthClientSecretFile)
		}
		return secret, nil
	}
	if s.OAuthClientSecret == "" {
		return "", &Error{Flag: settings.KafkaOAuthClientSecretFile.Flag, Env: settings.KafkaOAuthClientSecretEnv + " or " + settings.KafkaOAuthClientSecretFile.Env,
			Msg: fmt.Sprintf("--kafka-oauth-token-url needs the client secret of --kafka-oauth-client-id: set %s, or name a file holding it", settings.KafkaOAuthClientSecretEnv)}
	}
	return s.OAuthClientSecret, nil
}

// oauthBearer returns the OAUTHBEARER mechanism of s, whose token source
// is shared by every connection of the process with the same settings.
func (s security) oauthBearer() (sasl.Mechanism, error) {
	var secret string
	if s.OAuthTokenURL != "" {
		var err *Error
		if secret, err = s.clientSecret(); err != nil {
			return nil, err
		}
	}
	return oauthBearer{tokens: tokenFor(s, secret), extensions: s.OAuthExtensions}, nil
}
