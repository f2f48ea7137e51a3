package kafkaconn_test

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/runtime"
)

func TestBadSecuritySettingsNameTheSetting(t *testing.T) {
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "not.pem")
	if err := os.WriteFile(notPEM, []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		s    runtime.KafkaSecurity
		want []string
	}{
		{"SASL without user", runtime.KafkaSecurity{SASLMechanism: "SCRAM-SHA-512", SASLPassword: "p"}, []string{"--kafka-sasl-user (KFN_KAFKA_SASL_USER)", "needs a user"}},
		{"SASL without password", runtime.KafkaSecurity{SASLMechanism: "PLAIN", SASLUser: "u"}, []string{"KFN_KAFKA_SASL_PASSWORD", "--kafka-sasl-password-file", "needs a password"}},
		{"unreadable password file", runtime.KafkaSecurity{SASLMechanism: "PLAIN", SASLUser: "u", SASLPasswordFile: filepath.Join(dir, "missing")}, []string{"--kafka-sasl-password-file (KFN_KAFKA_SASL_PASSWORD_FILE)", "cannot read"}},
		{"unknown mechanism", runtime.KafkaSecurity{SASLMechanism: "GSSAPI", SASLUser: "u", SASLPassword: "p"}, []string{"--kafka-sasl-mechanism (KFN_KAFKA_SASL_MECHANISM)", "GSSAPI"}},
		{"user without mechanism", runtime.KafkaSecurity{SASLUser: "u"}, []string{"--kafka-sasl-mechanism", "not set"}},
		{"cert without key", runtime.KafkaSecurity{CertFile: notPEM}, []string{"--kafka-key (KFN_KAFKA_KEY)", "without its private key"}},
		{"key without cert", runtime.KafkaSecurity{KeyFile: notPEM}, []string{"--kafka-cert (KFN_KAFKA_CERT)", "without its certificate"}},
		{"unreadable CA", runtime.KafkaSecurity{CAFile: filepath.Join(dir, "missing-ca.pem")}, []string{"--kafka-ca (KFN_KAFKA_CA)", "cannot read the CA file"}},
		{"CA not PEM", runtime.KafkaSecurity{CAFile: notPEM}, []string{"--kafka-ca (KFN_KAFKA_CA)", "no PEM certificate"}},
		{"OAUTHBEARER without a token", runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER"}, []string{"--kafka-oauth-token-url (KFN_KAFKA_OAUTH_TOKEN_URL)", "--kafka-oauth-token-file", "needs a token"}},
		{"token URL without client id", runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenURL: "https://idp.example/token", OAuthClientSecret: "s"}, []string{"--kafka-oauth-client-id (KFN_KAFKA_OAUTH_CLIENT_ID)", "client id"}},
		{"token URL without secret", runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenURL: "https://idp.example/token", OAuthClientID: "c"}, []string{"KFN_KAFKA_OAUTH_CLIENT_SECRET", "--kafka-oauth-client-secret-file", "needs the client secret"}},
		{"unreadable client secret file", runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenURL: "https://idp.example/token", OAuthClientID: "c", OAuthClientSecretFile: filepath.Join(dir, "missing")}, []string{"--kafka-oauth-client-secret-file (KFN_KAFKA_OAUTH_CLIENT_SECRET_FILE)", "cannot read"}},
		{"token URL not a URL", runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenURL: "idp.example/token", OAuthClientID: "c", OAuthClientSecret: "s"}, []string{"--kafka-oauth-token-url (KFN_KAFKA_OAUTH_TOKEN_URL)", "not an http(s) URL"}},
		{"token URL and token file", runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenURL: "https://idp.example/token", OAuthClientID: "c", OAuthClientSecret: "s", OAuthTokenFile: notPEM}, []string{"--kafka-oauth-token-file (KFN_KAFKA_OAUTH_TOKEN_FILE)", "not both"}},
		{"unreadable token file", runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenFile: filepath.Join(dir, "missing-token")}, []string{"--kafka-oauth-token-file (KFN_KAFKA_OAUTH_TOKEN_FILE)", "cannot read"}},
		{"extension named auth", runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenFile: notPEM, OAuthExtensions: []string{"auth=x"}}, []string{"--kafka-oauth-extensions (KFN_KAFKA_OAUTH_EXTENSIONS)", "key=value"}},
		{"extension value with a control byte", runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenFile: notPEM, OAuthExtensions: []string{"logicalCluster=lkc\x01x"}}, []string{"--kafka-oauth-extensions (KFN_KAFKA_OAUTH_EXTENSIONS)", "printable ASCII"}},
		{"OAuth settings with SCRAM", runtime.KafkaSecurity{SASLMechanism: "SCRAM-SHA-512", SASLUser: "u", SASLPassword: "p", OAuthTokenFile: notPEM}, []string{"--kafka-sasl-mechanism (KFN_KAFKA_SASL_MECHANISM)", "set it to OAUTHBEARER"}},
		{"SASL user with OAUTHBEARER", runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenFile: notPEM, SASLUser: "u"}, []string{"--kafka-sasl-user (KFN_KAFKA_SASL_USER)", "for PLAIN and SCRAM"}},
		{"AWS_MSK_IAM not built in", runtime.KafkaSecurity{TLS: true, SASLMechanism: "AWS_MSK_IAM"}, []string{"--kafka-sasl-mechanism (KFN_KAFKA_SASL_MECHANISM)", "not built into this binary", "github.com/kfn-dev/kfn/kafkaauth/mskiam"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := kafkaconn.Kafka(tc.s)
			if err == nil {
				t.Fatal("accepted")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestPasswordComesFromTheEnvironmentOrAFileNeverAFlag(t *testing.T) {
	t.Setenv(settings.KafkaSASLPasswordEnv, "from-env")
	t.Setenv("KFN_KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	var s runtime.KafkaSecurity
	kafkaconn.BindSecurity(settings.NewBinder(fs), &s)
	if err := fs.Parse([]string{"--kafka-sasl-user", "alice"}); err != nil {
		t.Fatal(err)
	}
	if fs.Lookup("kafka-sasl-password") != nil {
		t.Fatal("a --kafka-sasl-password flag exists")
	}
	if s.SASLPassword != "from-env" || s.SASLMechanism != "SCRAM-SHA-256" || s.SASLUser != "alice" {
		t.Fatalf("bound %+v", s)
	}
	if _, _, err := kafkaconn.Kafka(s); err != nil {
		t.Fatal(err)
	}
	pw := filepath.Join(t.TempDir(), "pw")
	os.WriteFile(pw, []byte("from-file\n"), 0o600)
	s.SASLPasswordFile = pw
	if _, d, err := kafkaconn.Kafka(s); err != nil || d.SASLMechanism == nil {
		t.Fatal(err)
	}
}
