package kafkaconn_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/runtime"
)

// login starts an OAUTHBEARER login with sec's mechanism, as kafka-go does
// for each connection it opens, and returns the token it sends.
func login(t *testing.T, sec runtime.KafkaSecurity) (string, error) {
	t.Helper()
	transport, _, err := kafkaconn.Kafka(sec)
	if err != nil {
		t.Fatal(err)
	}
	_, ir, err := transport.SASL.Start(context.Background())
	if err != nil {
		return "", err
	}
	msg := string(ir)
	if !strings.HasPrefix(msg, "n,,\x01auth=Bearer ") || !strings.HasSuffix(msg, "\x01\x01") {
		t.Fatalf("the client's first message %q is not RFC 7628's", msg)
	}
	tok, _, _ := strings.Cut(strings.TrimPrefix(msg, "n,,\x01auth=Bearer "), "\x01")
	return tok, nil
}

func TestOAuthBearerFirstMessageIsRFC7628s(t *testing.T) {
	file := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(file, []byte("tok.en.value\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		extensions []string
		want       string
	}{
		{nil, "n,,\x01auth=Bearer tok.en.value\x01\x01"},
		{[]string{"logicalCluster=lkc-1", "identityPoolId=pool-2"}, "n,,\x01auth=Bearer tok.en.value\x01logicalCluster=lkc-1\x01identityPoolId=pool-2\x01\x01"},
	} {
		transport, _, err := kafkaconn.Kafka(runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenFile: file, OAuthExtensions: tc.extensions})
		if err != nil {
			t.Fatal(err)
		}
		if transport.SASL.Name() != "OAUTHBEARER" {
			t.Errorf("mechanism %s", transport.SASL.Name())
		}
		sess, ir, err := transport.SASL.Start(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if string(ir) != tc.want {
			t.Errorf("first message %q, want %q", ir, tc.want)
		}
		if done, _, err := sess.Next(context.Background(), nil); !done || err != nil {
			t.Errorf("an empty server answer is success: done %v, err %v", done, err)
		}
		if _, _, err := sess.Next(context.Background(), []byte(`{"status":"invalid_token"}`)); err == nil || !strings.Contains(err.Error(), "invalid_token") {
			t.Errorf("a server error answer: %v", err)
		}
	}
}

func TestOAuthTokensAreRefreshedBeforeTheyExpire(t *testing.T) {
	tokens := newTokenServer(t)
	const lifetime = 2 * time.Second
	tokens.addClient("unit", "secret", lifetime)
	sec := runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenURL: tokens.TokenURL(), OAuthClientID: "unit", OAuthClientSecret: "secret"}
	first, err := login(t, sec)
	if err != nil {
		t.Fatal(err)
	}
	if again, _ := login(t, sec); again != first {
		t.Error("a second connection fetched a token of its own instead of sharing the valid one")
	}
	// 80% of the lifetime is 1.6 s: the background refresh has run by 1.8 s.
	time.Sleep(lifetime * 9 / 10)
	second, err := login(t, sec)
	if err != nil {
		t.Fatal(err)
	}
	issued := tokens.issuedTo("unit")
	if len(issued) != 2 {
		t.Fatalf("%d tokens issued, want 2 (the first and one refresh)", len(issued))
	}
	if second == first {
		t.Error("a login at 90% of the token's lifetime still sends the first token")
	}
	if !issued[1].at.Before(issued[0].expiry) {
		t.Errorf("the refresh came at %s, after the first token expired at %s", issued[1].at, issued[0].expiry)
	}
	if lead := issued[0].expiry.Sub(issued[1].at); lead < lifetime/20 {
		t.Errorf("the refresh came %s before the expiry, want about %s (20%% of the lifetime)", lead, lifetime/5)
	}
}

func TestAWrongClientSecretNamesTheSettings(t *testing.T) {
	tokens := newTokenServer(t)
	tokens.addClient("unit-wrong", "right", time.Hour)
	_, err := login(t, runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenURL: tokens.TokenURL(), OAuthClientID: "unit-wrong", OAuthClientSecret: "not-the-secret-4711"})
	if err == nil {
		t.Fatal("a wrong secret got a token")
	}
	for _, want := range []string{"--kafka-oauth-token-url (KFN_KAFKA_OAUTH_TOKEN_URL)", `--kafka-oauth-client-id (KFN_KAFKA_OAUTH_CLIENT_ID) "unit-wrong"`, "KFN_KAFKA_OAUTH_CLIENT_SECRET or --kafka-oauth-client-secret-file", "invalid_client"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, err)
		}
	}
	if strings.Contains(err.Error(), "not-the-secret-4711") {
		t.Errorf("the error shows the secret: %v", err)
	}
	if !kafkaconn.IsSecurity(err) {
		t.Errorf("not a security error: %v", err)
	}
}

func TestATokenFileIsReadAgainWhenItChanges(t *testing.T) {
	file := filepath.Join(t.TempDir(), "token")
	write := func(tok string, n int) {
		t.Helper()
		if err := os.WriteFile(file, []byte(tok), 0o600); err != nil {
			t.Fatal(err)
		}
		at := time.Now().Add(time.Duration(n) * time.Second)
		if err := os.Chtimes(file, at, at); err != nil {
			t.Fatal(err)
		}
	}
	sec := runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenFile: file}
	write("first-token", 1)
	if tok, err := login(t, sec); err != nil || tok != "first-token" {
		t.Fatalf("token %q, %v", tok, err)
	}
	write("second-token", 2)
	if tok, err := login(t, sec); err != nil || tok != "second-token" {
		t.Fatalf("after the file changed: token %q, %v", tok, err)
	}

	// A JWT whose exp has passed is refused before any broker sees it.
	expired := signJWT(newTokenServer(t).key, "k", map[string]any{"sub": "x", "exp": time.Now().Add(-time.Minute).Unix()})
	write(expired, 3)
	_, err := login(t, sec)
	if err == nil || !strings.Contains(err.Error(), "--kafka-oauth-token-file (KFN_KAFKA_OAUTH_TOKEN_FILE)") || !strings.Contains(err.Error(), "expired") {
		t.Errorf("an expired token in the file: %v", err)
	}
}

func TestATokenFileIsReadInTheBackgroundOnceItsTokenIsDue(t *testing.T) {
	key := newTokenServer(t).key
	file := filepath.Join(t.TempDir(), "token")
	soon := time.Now().Add(2 * time.Second).Truncate(time.Second).Add(time.Second)
	first := signJWT(key, "k", map[string]any{"sub": "x", "exp": soon.Unix()})
	if err := os.WriteFile(file, []byte(first), 0o600); err != nil {
		t.Fatal(err)
	}
	sec := runtime.KafkaSecurity{SASLMechanism: "OAUTHBEARER", OAuthTokenFile: file}
	if tok, err := login(t, sec); err != nil || tok != first {
		t.Fatalf("token %q, %v", tok, err)
	}
	// Another process writes the next token late, after the refresh point
	// (80% of the lifetime); no connection is opened.
	time.Sleep(time.Until(soon) * 85 / 100)
	next := signJWT(key, "k", map[string]any{"sub": "x", "exp": time.Now().Add(time.Hour).Unix()})
	if err := os.WriteFile(file, []byte(next), 0o600); err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Second)
	if err := os.Chtimes(file, later, later); err != nil {
		t.Fatal(err)
	}
	for kafkaconn.CachedToken(sec) != next {
		if time.Now().After(soon) {
			t.Fatalf("the first token expired at %s, and the file's next token was not read", soon.Format(time.TimeOnly))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("read the file's next token %s before the first one expired", time.Until(soon).Round(time.Millisecond))
}
