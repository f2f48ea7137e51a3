package runtime

import (
	"os"

	"github.com/kfn-dev/kfn/internal/settings"
)

// KafkaSecurity is Config.KafkaSecurity: how the worker connects to Kafka,
// with TLS and SASL. Zero: plain TCP. Config.Bind reads it from
// --kafka-tls, --kafka-ca, --kafka-cert, --kafka-key, --kafka-server-name,
// --kafka-sasl-mechanism, --kafka-sasl-user, KFN_KAFKA_SASL_PASSWORD,
// --kafka-sasl-password-file, and the --kafka-oauth-* settings with
// KFN_KAFKA_OAUTH_CLIENT_SECRET (OAUTHBEARER).
type KafkaSecurity struct {
	TLS        bool   // KFN_KAFKA_TLS; implied by CAFile, CertFile and ServerName
	CAFile     string // KFN_KAFKA_CA: PEM CA certificates; empty: the system's
	CertFile   string // KFN_KAFKA_CERT: PEM client certificate (with KeyFile)
	KeyFile    string // KFN_KAFKA_KEY
	ServerName string // KFN_KAFKA_SERVER_NAME: verify the brokers' certificates against this name

	SASLMechanism string // KFN_KAFKA_SASL_MECHANISM: PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER or AWS_MSK_IAM; empty: no SASL
	SASLUser      string // KFN_KAFKA_SASL_USER

	// SASLPassword is the password itself, for a Go caller; Bind takes it
	// from KFN_KAFKA_SASL_PASSWORD (never from a flag). SASLPasswordFile
	// (KFN_KAFKA_SASL_PASSWORD_FILE) names a file holding it instead.
	SASLPassword     string
	SASLPasswordFile string

	// OAUTHBEARER: the token comes from the OAuth client-credentials flow
	// at OAuthTokenURL (with OAuthClientID and its secret) or from the file
	// OAuthTokenFile, read again whenever it changes.
	OAuthTokenURL string   // KFN_KAFKA_OAUTH_TOKEN_URL
	OAuthClientID string   // KFN_KAFKA_OAUTH_CLIENT_ID
	OAuthScopes   []string // KFN_KAFKA_OAUTH_SCOPES

	// OAuthClientSecret is the client secret itself, for a Go caller; Bind
	// takes it from KFN_KAFKA_OAUTH_CLIENT_SECRET (never from a flag).
	// OAuthClientSecretFile (KFN_KAFKA_OAUTH_CLIENT_SECRET_FILE) names a
	// file holding it instead.
	OAuthClientSecret     string
	OAuthClientSecretFile string

	OAuthTokenFile  string   // KFN_KAFKA_OAUTH_TOKEN_FILE: a file holding the token, instead of OAuthTokenURL
	OAuthExtensions []string // KFN_KAFKA_OAUTH_EXTENSIONS: SASL extensions, key=value
}

// bind registers the Kafka security flags (and their variables) on b, and
// reads the SASL password from KFN_KAFKA_SASL_PASSWORD and the OAuth
// client secret from KFN_KAFKA_OAUTH_CLIENT_SECRET.
func (s *KafkaSecurity) bind(b *settings.Binder) {
	settings.KafkaTLS.Bind(b, &s.TLS)
	settings.KafkaCA.Bind(b, &s.CAFile)
	settings.KafkaCert.Bind(b, &s.CertFile)
	settings.KafkaKey.Bind(b, &s.KeyFile)
	settings.KafkaServerName.Bind(b, &s.ServerName)
	settings.KafkaSASLMechanism.Bind(b, &s.SASLMechanism)
	settings.KafkaSASLUser.Bind(b, &s.SASLUser)
	settings.KafkaSASLPasswordFile.Bind(b, &s.SASLPasswordFile)
	s.SASLPassword = os.Getenv(settings.KafkaSASLPasswordEnv)
	settings.KafkaOAuthTokenURL.Bind(b, &s.OAuthTokenURL)
	settings.KafkaOAuthClientID.Bind(b, &s.OAuthClientID)
	settings.KafkaOAuthClientSecretFile.Bind(b, &s.OAuthClientSecretFile)
	settings.KafkaOAuthScopes.Bind(b, &s.OAuthScopes)
	settings.KafkaOAuthTokenFile.Bind(b, &s.OAuthTokenFile)
	settings.KafkaOAuthExtensions.Bind(b, &s.OAuthExtensions)
	s.OAuthClientSecret = os.Getenv(settings.KafkaOAuthClientSecretEnv)
}

// NATSSecurity is Config.NATSSecurity: how the worker proves itself to NATS
// and checks the server, besides what the URL holds (user:pass@ or
// token@): at most one of a credentials file, an NKey seed file and a
// token file, and TLS with a CA file and an optional client certificate.
// Zero: what Config.NATSURL says.
type NATSSecurity struct {
	Creds     string // --nats-creds (KFN_NATS_CREDS): a .creds file (user JWT and NKey seed)
	NKeyFile  string // --nats-nkey (KFN_NATS_NKEY): a file holding a user NKey seed
	TokenFile string // --nats-token-file (KFN_NATS_TOKEN_FILE): a file holding the token
	CAFile    string // --nats-ca (KFN_NATS_CA): PEM CA certificates that sign the servers' certificates
	CertFile  string // --nats-cert (KFN_NATS_CERT): PEM client certificate (with KeyFile)
	KeyFile   string // --nats-key (KFN_NATS_KEY): PEM private key of CertFile
}

// bind registers the NATS credential and TLS flags (and their variables)
// on b.
func (s *NATSSecurity) bind(b *settings.Binder) {
	settings.NATSCreds.Bind(b, &s.Creds)
	settings.NATSNKey.Bind(b, &s.NKeyFile)
	settings.NATSTokenFile.Bind(b, &s.TokenFile)
	settings.NATSCA.Bind(b, &s.CAFile)
	settings.NATSCert.Bind(b, &s.CertFile)
	settings.NATSKey.Bind(b, &s.KeyFile)
}
