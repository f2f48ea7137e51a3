package console

import (
	"bytes"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"
)

// loginForm fetches the login page with c and returns its CSRF token.
func loginForm(t *testing.T, c *http.Client, base string) string {
	t.Helper()
	code, body := get(t, c, base, "/login")
	m := csrfField.FindStringSubmatch(body)
	if code != http.StatusOK || m == nil {
		t.Fatalf("login page: %d, no csrf field", code)
	}
	return m[1]
}

// postLogin posts the login form and returns the response, its body read.
func postLogin(t *testing.T, c *http.Client, base, token, user, secret string) (*http.Response, string) {
	t.Helper()
	res, err := c.PostForm(base+"/login", url.Values{"csrf": {token}, "user": {user}, "secret": {secret}})
	if err != nil {
		t.Fatal(err)
	}
	var body bytes.Buffer
	body.ReadFrom(res.Body) //nolint:errcheck // a short body from a test server
	res.Body.Close()
	return res, body.String()
}

// TestFiveWrongSecretsLockTheUserOutEvenFromTheRightSecret guesses alice's
// secret five times over HTTP: then her right secret gets 429 with a
// Retry-After and no session, a name that does not exist gets the same
// answer after as many guesses, the lockout is logged once, and once the
// lockout is over (the limiter's clock moved) the right secret logs in.
func TestFiveWrongSecretsLockTheUserOutEvenFromTheRightSecret(t *testing.T) {
	var logs bytes.Buffer
	st := setup(t, func(c *Config) { c.Log = slog.New(slog.NewTextHandler(&logs, nil)) })
	clk := &clock{t: time.Now()}
	st.console.logins.now = clk.now
	c := client(t)
	token := loginForm(t, c, st.srv.URL)
	for i := range userFailures {
		if res, _ := postLogin(t, c, st.srv.URL, token, "alice", "wrong-"+itoa(int64(i))); res.StatusCode != http.StatusUnauthorized {
			t.Fatalf("wrong secret %d: %d, want 401", i+1, res.StatusCode)
		}
	}
	res, body := postLogin(t, c, st.srv.URL, token, "alice", "alice-secret")
	if res.StatusCode != http.StatusTooManyRequests || res.Header.Get("Retry-After") != "60" || !strings.Contains(body, "too many failed logins: try again in 1m0s") {
		t.Fatalf("the right secret after 5 wrong ones: %d, Retry-After %q\n%s", res.StatusCode, res.Header.Get("Retry-After"), body)
	}
	if code, _ := get(t, c, st.srv.URL, "/deadletters"); code != http.StatusUnauthorized {
		t.Fatalf("GET after a locked-out login: %d, want 401 (the right secret got in)", code)
	}
	// A name nobody has: the same answer after the same guesses, so a
	// lockout does not tell a name that exists from one that does not.
	other := client(t)
	otherToken := loginForm(t, other, st.srv.URL)
	for range userFailures {
		postLogin(t, other, st.srv.URL, otherToken, "mallory", "guess")
	}
	res2, body2 := postLogin(t, other, st.srv.URL, otherToken, "mallory", "guess")
	if res2.StatusCode != res.StatusCode || res2.Header.Get("Retry-After") != res.Header.Get("Retry-After") ||
		strings.ReplaceAll(body2, otherToken, "T") != strings.ReplaceAll(body, token, "T") {
		t.Errorf("a locked-out name that does not exist: %d %q, want the same answer as alice's (%d %q)\n%s\n%s",
			res2.StatusCode, res2.Header.Get("Retry-After"), res.StatusCode, res.Header.Get("Retry-After"), body2, body)
	}
	if n := strings.Count(logs.String(), "console login locked out"); n != 1 {
		t.Errorf("%d lockout lines for two lockouts in a second, want 1 (the second held back):\n%s", n, logs.String())
	}
	if !strings.Contains(logs.String(), "user=alice") {
		t.Errorf("the lockout line does not name alice:\n%s", logs.String())
	}
	clk.advance(firstLockout)
	if res, body := postLogin(t, c, st.srv.URL, token, "alice", "alice-secret"); res.StatusCode != http.StatusOK || !strings.Contains(body, "Overview") {
		t.Fatalf("the right secret once the lockout is over: %d\n%s", res.StatusCode, body)
	}
	if code, _ := get(t, c, st.srv.URL, "/deadletters"); code != http.StatusOK {
		t.Fatalf("GET after logging in: %d", code)
	}
}

// TestLoginsCountAgainstTheAddressTheProxyHeaderGives serves a console
// told that its proxy sets X-Real-IP: twenty failures of twenty names
// from one client lock that client out, and another client behind the
// same proxy (the same TCP peer) logs in.
func TestLoginsCountAgainstTheAddressTheProxyHeaderGives(t *testing.T) {
	st := setup(t, func(c *Config) { c.ClientAddressHeader = "X-Real-IP" })
	c := client(t)
	token := loginForm(t, c, st.srv.URL)
	attempt := func(client, user, secret string) int {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, st.srv.URL+"/login", strings.NewReader(url.Values{"csrf": {token}, "user": {user}, "secret": {secret}}.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("X-Real-IP", client)
		res, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		return res.StatusCode
	}
	for i := range addressFailures {
		if code := attempt("198.51.100.1", "guess-"+itoa(int64(i)), "x"); code != http.StatusUnauthorized {
			t.Fatalf("failure %d: %d, want 401", i+1, code)
		}
	}
	if code := attempt("198.51.100.1", "alice", "alice-secret"); code != http.StatusTooManyRequests {
		t.Fatalf("alice from the locked-out client: %d, want 429", code)
	}
	if code := attempt("198.51.100.2", "alice", "alice-secret"); code != http.StatusOK {
		t.Fatalf("alice from another client behind the proxy: %d, want 200", code)
	}
}
