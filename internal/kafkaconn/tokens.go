package kafkaconn

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"
	"weak"

	"github.com/segmentio/kafka-go"

	"golang.org/x/oauth2"
	"golang.org/x/oauth2/clientcredentials"

	"github.com/kfn-dev/kfn/internal/settings"
)

// Token refresh timing. A token is refreshed once refreshFactor of its
// lifetime has passed (Kafka's Java clients use the same 0.8 window), in
// the background, so that the connections opened after that point log in
// with a token that has most of its life ahead, and a connection the
// broker closes at the old token's expiry is opened again without
// waiting for the token endpoint.
const (
	refreshFactor = 0.8
	// unknownLifetime is taken for a token whose expiry neither the token
	// endpoint (expires_in) nor the token (a JWT's exp) states.
	unknownLifetime = 5 * time.Minute
	// fetchTimeout bounds one request to the token endpoint.
	fetchTimeout = 10 * time.Second
	// filePoll is how often, at most, a token file is looked at once its
	// token is due for a refresh, until it changes (a quarter of the time
	// the token has left, when that is less).
	filePoll = time.Second
	// minRetry and maxRetry bound the wait between failed background
	// refreshes.
	minRetry = time.Second
	maxRetry = 30 * time.Second
)

// tokenSource hands out the OAUTHBEARER token of one set of settings. All
// of a process's connections with the same settings share one (tokenFor),
// so that a worker's many readers ask the token endpoint once per
// refresh, not once per connection.
type tokenSource struct {
	fetch func(ctx context.Context) (token string, expiry time.Time, err error)
	// describe says where tokens come from, for errors and logs.
	describe string
	// file: a token file, read again when it changes (a stat per Token,
	// and in the background from the refresh point on).
	file string

	fetchMu sync.Mutex // one fetch at a time
	mu      sync.Mutex
	token   string
	expiry  time.Time
	refresh time.Time // when the background refresh is due
	fileAt  fileStamp // the file's stamp when token was read
	timer   *time.Timer
	// transports are the kafka-go transports whose connections log in
	// with this source's tokens; a refresh closes their connections as
	// soon as each is idle (see renewConnections).
	transports []weak.Pointer[kafka.Transport]
}

type fileStamp struct {
	mod  time.Time
	size int64
}

var (
	sourcesMu sync.Mutex
	sources   = map[string]*tokenSource{}
)

// tokenFor returns the process's token source for s's OAUTHBEARER
// settings; s has passed Check.
func tokenFor(s security, secret string) *tokenSource {
	key := strings.Join([]string{s.OAuthTokenURL, s.OAuthClientID, secret, strings.Join(s.OAuthScopes, " "), s.OAuthTokenFile}, "\x00")
	sourcesMu.Lock()
	defer sourcesMu.Unlock()
	if src, ok := sources[key]; ok {
		return src
	}
	var src *tokenSource
	if s.OAuthTokenFile != "" {
		src = &tokenSource{file: s.OAuthTokenFile, describe: "--kafka-oauth-token-file " + s.OAuthTokenFile}
		src.fetch = src.readFile
	} else {
		src = clientCredentials(s, secret)
	}
	sources[key] = src
	return src
}

// clientCredentials is a token source of the OAuth client-credentials
// flow (RFC 6749 section 4.4) at s's token URL.
func clientCredentials(s security, secret string) *tokenSource {
	cfg := clientcredentials.Config{ClientID: s.OAuthClientID, ClientSecret: secret, TokenURL: s.OAuthTokenURL, Scopes: s.OAuthScopes}
	client := &http.Client{Timeout: fetchTimeout}
	src := &tokenSource{describe: s.OAuthTokenURL}
	src.fetch = func(ctx context.Context) (string, time.Time, error) {
		tok, err := cfg.Token(context.WithValue(ctx, oauth2.HTTPClient, client))
		if err != nil {
			return "", time.Time{}, tokenEndpointError(s, err)
		}
		// The earlier of expires_in and a JWT's own exp, which is what a
		// broker checks.
		expiry := tok.Expiry
		if exp := jwtExpiry(tok.AccessToken); !exp.IsZero() && (expiry.IsZero() || exp.Before(expiry)) {
			expiry = exp
		}
		return tok.AccessToken, expiry, nil
	}
	return src
}

// tokenEndpointError says which setting to fix when the token endpoint
// refused to issue a token, or could not be reached.
func tokenEndpointError(s security, err error) error {
	at := fmt.Sprintf("cannot get a Kafka OAUTHBEARER token from --kafka-oauth-token-url (%s) %s", settings.KafkaOAuthTokenURL.Env, s.OAuthTokenURL)
	var re *oauth2.RetrieveError
	if !errors.As(err, &re) {
		return securityError(err, "%s: the token endpoint does not answer", at)
	}
	status := 0
	if re.Response != nil {
		status = re.Response.StatusCode
	}
	switch {
	case re.ErrorCode == "invalid_client" || re.ErrorCode == "unauthorized_client" || status == http.StatusUnauthorized:
		return securityError(err, "%s: the token endpoint refused --kafka-oauth-client-id (%s) %q with its secret (%s or --kafka-oauth-client-secret-file): check both",
			at, settings.KafkaOAuthClientID.Env, s.OAuthClientID, settings.KafkaOAuthClientSecretEnv)
	case re.ErrorCode == "invalid_scope":
		return securityError(err, "%s: the token endpoint refused the scopes of --kafka-oauth-scopes (%s) %q", at, settings.KafkaOAuthScopes.Env, strings.Join(s.OAuthScopes, ","))
	}
	return securityError(err, "%s: the token endpoint answered HTTP %d", at, status)
}

// readFile reads the token file: the token, and its expiry if it is a
// JWT.
func (t *tokenSource) readFile(context.Context) (string, time.Time, error) {
	b, err := os.ReadFile(t.file)
	if err != nil {
		return "", time.Time{}, problem(settings.KafkaOAuthTokenFile, "cannot read the OAUTHBEARER token: %v", err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", time.Time{}, problem(settings.KafkaOAuthTokenFile, "%s is empty: it must hold the OAUTHBEARER token", t.file)
	}
	return tok, jwtExpiry(tok), nil
}

// jwtExpiry returns the exp claim of a JWT, without verifying it (the
// broker does); zero if tok is not a JWT with one.
func jwtExpiry(tok string) time.Time {
	parts := strings.Split(tok, ".")
	if len(parts) != 3 {
		return time.Time{}
	}
	payload, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(parts[1], "="))
	if err != nil {
		return time.Time{}
	}
	var claims struct {
		Exp json.Number `json:"exp"`
	}
	if json.Unmarshal(payload, &claims) != nil {
		return time.Time{}
	}
	exp, err := claims.Exp.Float64()
	if err != nil || exp <= 0 {
		return time.Time{}
	}
	return time.Unix(0, int64(exp*float64(time.Second)))
}

// Token returns a token to log in with: the current one while it is
// valid, else a new one, fetched now. A token file is read again when
// its modification time or size changed.
func (t *tokenSource) Token(ctx context.Context) (string, error) {
	if tok, ok := t.current(); ok {
		return tok, nil
	}
	t.fetchMu.Lock()
	defer t.fetchMu.Unlock()
	if tok, ok := t.current(); ok { // another connection fetched it meanwhile
		return tok, nil
	}
	if err := t.fetchNow(ctx); err != nil {
		return "", err
	}
	tok, _ := t.current()
	return tok, nil
}

// current returns the current token if it can still be used: not expired,
// and for a file, the file unchanged.
func (t *tokenSource) current() (string, bool) {
	var stamp fileStamp
	if t.file != "" {
		if fi, err := os.Stat(t.file); err == nil {
			stamp = fileStamp{fi.ModTime(), fi.Size()}
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.token == "" || !time.Now().Before(t.expiry) || stamp != t.fileAt {
		return "", false
	}
	return t.token, true
}

// fetchNow fetches a token (reads the file), schedules its background
// refresh, and when it replaces a token, renews the watched transports'
// connections. The caller holds fetchMu.
func (t *tokenSource) fetchNow(ctx context.Context) error {
	var stamp fileStamp
	if t.file != "" {
		if fi, err := os.Stat(t.file); err == nil {
			stamp = fileStamp{fi.ModTime(), fi.Size()}
		}
	}
	ctx, cancel := context.WithTimeout(ctx, fetchTimeout)
	defer cancel()
	tok, expiry, err := t.fetch(ctx)
	if err != nil {
		return err
	}
	now := time.Now()
	if expiry.IsZero() {
		expiry = now.Add(unknownLifetime)
	}
	if !now.Before(expiry) {
		if t.file != "" {
			return problem(settings.KafkaOAuthTokenFile, "the token in %s expired at %s: whatever writes the file no longer refreshes it", t.file, expiry.UTC().Format(time.RFC3339))
		}
		return securityError(errors.New("expired token"), "the token endpoint %s issued a token that expired at %s (is this machine's clock right?)", t.describe, expiry.UTC().Format(time.RFC3339))
	}
	t.mu.Lock()
	renewed := t.token != ""
	t.token, t.expiry, t.fileAt = tok, expiry, stamp
	t.refresh = now.Add(time.Duration(refreshFactor * float64(expiry.Sub(now))))
	t.schedule(time.Until(t.refresh))
	t.mu.Unlock()
	if renewed {
		t.renewConnections()
	}
	return nil
}

// watch notes that tr's connections log in with t's tokens.
func (t *tokenSource) watch(tr *kafka.Transport) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.transports = append(t.transports, weak.Make(tr))
}

// renewConnections has every watched transport close its connections, each
// once it is idle: a request under way on one finishes first, and the
// next request opens a new connection, which logs in with the new token.
// Without it, a connection would go on with the token it logged in with
// until a broker that enforces token expiry (connections.max.reauth.ms)
// closed it at its first request after that token expired, failing that
// request (kafka-go cannot log in again on an open connection).
func (t *tokenSource) renewConnections() {
	t.mu.Lock()
	var live []*kafka.Transport
	kept := t.transports[:0]
	for _, w := range t.transports {
		if tr := w.Value(); tr != nil {
			live = append(live, tr)
			kept = append(kept, w)
		}
	}
	clear(t.transports[len(kept):])
	t.transports = kept
	t.mu.Unlock()
	for _, tr := range live {
		tr.CloseIdleConnections()
	}
}

// schedule runs the background refresh after d. The caller holds mu.
func (t *tokenSource) schedule(d time.Duration) {
	if t.timer != nil {
		t.timer.Stop()
	}
	t.timer = time.AfterFunc(d, t.refreshInBackground)
}

// refreshInBackground fetches the next token while the current one is
// still valid. When the fetch fails it tries again, with a wait of half
// the time the current token has left (between minRetry and maxRetry),
// until that token expires; then it stops, and the next connection's
// login fetches a token itself (and fails with the endpoint's error if
// it still cannot).
//
// A token file is another process's to refresh: from the refresh point on,
// the file is looked at (filePoll) until it changes, and then read.
func (t *tokenSource) refreshInBackground() {
	t.fetchMu.Lock()
	defer t.fetchMu.Unlock()
	if _, unchanged := t.current(); unchanged && t.file != "" {
		t.mu.Lock()
		defer t.mu.Unlock()
		if left := time.Until(t.expiry); left > 0 {
			t.schedule(max(min(left/4, filePoll), 10*time.Millisecond))
		}
		return
	}
	err := t.fetchNow(context.Background())
	if err == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	left := time.Until(t.expiry)
	slog.Default().Warn("cannot refresh the Kafka OAUTHBEARER token: the current one stays in use until it expires",
		"token_source", t.describe, "expires_in", left.Round(time.Second), "err", err)
	if left <= 0 {
		return
	}
	t.schedule(min(max(left/2, minRetry), maxRetry))
}
