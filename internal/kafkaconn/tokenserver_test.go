package kafkaconn_test

import (
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// tokenServer is an OAuth token endpoint and JWKS of the tests' own: it
// issues RS256 JWTs to the clients it knows (client-credentials flow) and
// serves its public key as a JWKS at /jwks, where a broker's
// OAuthBearerValidatorCallbackHandler checks the tokens' signatures.
type tokenServer struct {
	*httptest.Server
	key *rsa.PrivateKey
	kid string

	mu      sync.Mutex
	clients map[string]tokenClient
	issued  []issuedToken
	refused int
}

// tokenClient is a client the server knows: its secret, and the lifetime
// of the tokens it issues to it.
type tokenClient struct {
	secret   string
	lifetime time.Duration
}

// issuedToken is one token the server issued.
type issuedToken struct {
	client string
	at     time.Time
	expiry time.Time
}

// tokenAudience is the audience of the server's tokens, which the broker
// of kafka.sh wants by default (KFN_KAFKA_OAUTH_AUDIENCE).
const tokenAudience = "kafka"

func newTokenServer(t *testing.T) *tokenServer {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	s := &tokenServer{key: key, kid: "kfn-test-1", clients: map[string]tokenClient{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /token", s.token)
	mux.HandleFunc("GET /jwks", s.jwks)
	s.Server = httptest.NewServer(mux)
	t.Cleanup(s.Close)
	return s
}

// TokenURL is the server's token endpoint; JWKSURL its keys.
func (s *tokenServer) TokenURL() string { return s.URL + "/token" }
func (s *tokenServer) JWKSURL() string  { return s.URL + "/jwks" }

// addClient lets client id log in with secret, and get tokens that
// expire lifetime after they are issued.
func (s *tokenServer) addClient(id, secret string, lifetime time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.clients[id] = tokenClient{secret, lifetime}
}

// issuedTo returns the tokens issued to client, in order.
func (s *tokenServer) issuedTo(client string) []issuedToken {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []issuedToken
	for _, it := range s.issued {
		if it.client == client {
			out = append(out, it)
		}
	}
	return out
}

func (s *tokenServer) token(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	id, secret, ok := r.BasicAuth()
	if !ok {
		id, secret = r.PostForm.Get("client_id"), r.PostForm.Get("client_secret")
	}
	w.Header().Set("Content-Type", "application/json")
	s.mu.Lock()
	client, known := s.clients[id]
	lifetime := client.lifetime
	if !known || secret != client.secret {
		s.refused++
		s.mu.Unlock()
		w.WriteHeader(http.StatusUnauthorized)
		json.NewEncoder(w).Encode(map[string]string{"error": "invalid_client", "error_description": "client authentication failed"})
		return
	}
	s.mu.Unlock()
	if r.PostForm.Get("grant_type") != "client_credentials" {
		w.WriteHeader(http.StatusBadRequest)
		json.NewEncoder(w).Encode(map[string]string{"error": "unsupported_grant_type"})
		return
	}
	now := time.Now()
	// exp is in whole seconds: the next one after the lifetime ends, so
	// that the token is valid for at least expires_in.
	exp := now.Add(lifetime).Truncate(time.Second).Add(time.Second)
	claims := map[string]any{"iss": s.URL, "sub": id, "aud": tokenAudience, "iat": now.Unix(), "exp": exp.Unix()}
	if scope := r.PostForm.Get("scope"); scope != "" {
		claims["scope"] = scope
	}
	tok := s.sign(claims)
	s.mu.Lock()
	s.issued = append(s.issued, issuedToken{client: id, at: now, expiry: exp})
	s.mu.Unlock()
	json.NewEncoder(w).Encode(map[string]any{"access_token": tok, "token_type": "Bearer", "expires_in": int(lifetime / time.Second)})
}

// sign returns claims as a JWT signed with the server's key (RS256).
func (s *tokenServer) sign(claims map[string]any) string {
	return signJWT(s.key, s.kid, claims)
}

func signJWT(key *rsa.PrivateKey, kid string, claims map[string]any) string {
	enc := func(v any) string {
		b, err := json.Marshal(v)
		if err != nil {
			panic(err)
		}
		return base64.RawURLEncoding.EncodeToString(b)
	}
	signed := enc(map[string]string{"alg": "RS256", "typ": "JWT", "kid": kid}) + "." + enc(claims)
	sum := sha256.Sum256([]byte(signed))
	sig, err := rsa.SignPKCS1v15(rand.Reader, key, crypto.SHA256, sum[:])
	if err != nil {
		panic(err)
	}
	return signed + "." + base64.RawURLEncoding.EncodeToString(sig)
}

func (s *tokenServer) jwks(w http.ResponseWriter, _ *http.Request) {
	b64 := func(b []byte) string { return base64.RawURLEncoding.EncodeToString(b) }
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"keys": []map[string]string{{
		"kty": "RSA", "use": "sig", "alg": "RS256", "kid": s.kid,
		"n": b64(s.key.N.Bytes()), "e": b64(big.NewInt(int64(s.key.E)).Bytes()),
	}}})
}

// firstLine is the first line of s.
func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}
