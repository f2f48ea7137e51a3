package console

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/dlqtest"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

// testUsers are alice (writer) and victor (viewer).
func testUsers(t *testing.T) []User {
	t.Helper()
	users, err := ParseAuthFile(strings.NewReader("# the test's users\n\n" +
		"alice:writer:sha256:" + sha256Hex("alice-secret") + "\n" +
		"victor:viewer:sha256:" + sha256Hex("victor-secret") + "\n"))
	if err != nil {
		t.Fatal(err)
	}
	return users
}

// stack is a console over a fresh database with three dead letters of
// "orders": two of one group, one of another.
type stack struct {
	db      *kfntest.PG
	console *Server
	srv     *httptest.Server
	ids     []int64
}

func setup(t *testing.T, mutate func(*Config)) stack {
	t.Helper()
	db := kfntest.Postgres(t)
	ids := dlqtest.Seed(t, db.Pool,
		dlqtest.Letter{Function: "orders", Topic: "orders", Partition: 0, Offset: 10, Reason: "handler_error", Error: "order 4411 not found", Key: []byte("k1"), Value: []byte(`{"id":4411}`)},
		dlqtest.Letter{Function: "orders", Topic: "orders", Partition: 1, Offset: 12, Reason: "handler_error", Error: "order 97 not found", Key: []byte("k2"), Value: []byte(`{"id":97}`)},
		dlqtest.Letter{Function: "orders", Topic: "orders", Partition: 0, Offset: 11, Reason: "permanent", Error: "bad currency", Key: []byte("k3"), Value: []byte("x")},
	)
	cfg := Config{Pool: db.Pool, Users: testUsers(t), AllowWrites: true}
	if mutate != nil {
		mutate(&cfg)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return stack{db: db, console: s, srv: srv, ids: ids}
}

// client is a browser-like client: a cookie jar, no redirects followed
// past the first response unless asked.
func client(t *testing.T) *http.Client {
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	return &http.Client{Jar: jar, Timeout: 30 * time.Second}
}

var csrfField = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// get fetches path and returns the status and body.
func get(t *testing.T, c *http.Client, base, path string) (int, string) {
	t.Helper()
	res, err := c.Get(base + path)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

func post(t *testing.T, c *http.Client, base, path string, form url.Values) (int, string) {
	t.Helper()
	res, err := c.PostForm(base+path, form)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

// login logs user in through the login form and returns the CSRF token of
// the pages it then sees.
func login(t *testing.T, c *http.Client, base, user, secret string) string {
	t.Helper()
	code, body := get(t, c, base, "/login")
	m := csrfField.FindStringSubmatch(body)
	if code != http.StatusOK || m == nil {
		t.Fatalf("login page: %d, no csrf field:\n%s", code, body)
	}
	code, body = post(t, c, base, "/login", url.Values{"csrf": {m[1]}, "user": {user}, "secret": {secret}, "next": {"/deadletters"}})
	if code != http.StatusOK || !strings.Contains(body, "Dead letters") {
		t.Fatalf("login as %s: %d\n%s", user, code, body)
	}
	m = csrfField.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no csrf token on the page after login:\n%s", body)
	}
	return m[1]
}

func count(t *testing.T, db *kfntest.PG, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestConsoleRefusesToStartWithoutAuthentication(t *testing.T) {
	db := kfntest.Postgres(t)
	if _, err := New(Config{Pool: db.Pool}); !errors.Is(err, ErrNoAuth) {
		t.Fatalf("New without users or proxy header: %v, want ErrNoAuth", err)
	}
	if _, err := New(Config{Pool: db.Pool, Users: testUsers(t), ProxyHeader: "X-Forwarded-User"}); err == nil {
		t.Fatal("New with both an auth file and a proxy header: no error")
	}
}

func TestAuthFileRefusesBadLines(t *testing.T) {
	for _, bad := range []string{
		"", "# only a comment\n",
		"alice:admin:sha256:" + sha256Hex("x"),
		"alice:writer:md5:" + sha256Hex("x"),
		"alice:writer:sha256:abcd",
		"alice:writer:" + sha256Hex("x"),
		"alice:writer:sha256:" + sha256Hex("x") + "\nalice:viewer:sha256:" + sha256Hex("y"),
	} {
		if _, err := ParseAuthFile(strings.NewReader(bad)); err == nil {
			t.Errorf("auth file %q: no error", bad)
		}
	}
}

func TestRequestWithoutCredentialsGets401(t *testing.T) {
	st := setup(t, nil)
	c := client(t)
	for _, path := range []string{"/", "/overview/live", "/deadletters", "/deadletters/1", "/parked", "/replay", "/audit", "/verify"} {
		code, body := get(t, c, st.srv.URL, path)
		if code != http.StatusUnauthorized {
			t.Errorf("GET %s without credentials: %d, want 401", path, code)
		}
		if strings.Contains(body, "order 4411") {
			t.Errorf("GET %s without credentials shows a dead letter", path)
		}
	}
	// A forged or stale session cookie is no credential either.
	u, _ := url.Parse(st.srv.URL)
	c.Jar.SetCookies(u, []*http.Cookie{{Name: sessionCookie, Value: "forged"}})
	if code, _ := get(t, c, st.srv.URL, "/deadletters"); code != http.StatusUnauthorized {
		t.Errorf("GET with a forged session: %d, want 401", code)
	}
	// A wrong secret does not log in.
	code, body := get(t, c, st.srv.URL, "/login")
	m := csrfField.FindStringSubmatch(body)
	if code != http.StatusOK || m == nil {
		t.Fatalf("login page: %d", code)
	}
	if code, _ := post(t, c, st.srv.URL, "/login", url.Values{"csrf": {m[1]}, "user": {"alice"}, "secret": {"wrong"}}); code != http.StatusUnauthorized {
		t.Errorf("login with a wrong secret: %d, want 401", code)
	}
	if code, _ := get(t, c, st.srv.URL, "/deadletters"); code != http.StatusUnauthorized {
		t.Errorf("GET after a failed login: %d, want 401", code)
	}
}

func TestProxyHeaderIsTheOnlyCredentialBehindAProxy(t *testing.T) {
	st := setup(t, func(c *Config) { c.Users, c.ProxyHeader, c.ProxyWriters = nil, "X-Forwarded-User", []string{"alice"} })
	res, err := http.Get(st.srv.URL + "/deadletters")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusUnauthorized {
		t.Fatalf("GET without the proxy header: %d, want 401", res.StatusCode)
	}
	req, _ := http.NewRequest(http.MethodGet, st.srv.URL+"/deadletters", nil)
	req.Header.Set("X-Forwarded-User", "alice")
	res, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusOK || !strings.Contains(string(b), "alice (writer)") {
		t.Fatalf("GET with the proxy header: %d\n%s", res.StatusCode, b)
	}
}

func TestPostWithoutCSRFTokenGets403(t *testing.T) {
	st := setup(t, nil)
	c := client(t)
	token := login(t, c, st.srv.URL, "alice", "alice-secret")
	for _, form := range []url.Values{
		{"id": {itoa(st.ids[0])}, "reason": {"no token"}},
		{"id": {itoa(st.ids[0])}, "reason": {"wrong token"}, "csrf": {token + "x"}},
	} {
		for _, path := range []string{"/deadletters/retry", "/deadletters/discard", "/replay", "/logout"} {
			if code, _ := post(t, c, st.srv.URL, path, form); code != http.StatusForbidden {
				t.Errorf("POST %s with csrf %q: %d, want 403", path, form.Get("csrf"), code)
			}
		}
	}
	if n := count(t, st.db, `SELECT count(*) FROM kfn.dead_letters WHERE retry_requested_at IS NULL`); n != 3 {
		t.Errorf("%d dead letters untouched after refused posts, want 3", n)
	}
	if n := count(t, st.db, `SELECT count(*) FROM kfn.audit_log WHERE actor LIKE 'console:%'`); n != 0 {
		t.Errorf("%d audit rows after refused posts, want 0", n)
	}
	// The login form is a POST too: without its token it is refused.
	if code, _ := post(t, client(t), st.srv.URL, "/login", url.Values{"user": {"alice"}, "secret": {"alice-secret"}}); code != http.StatusForbidden {
		t.Errorf("login without its CSRF token: %d, want 403", code)
	}
}

func TestWriteInReadOnlyConsoleGets403(t *testing.T) {
	st := setup(t, func(c *Config) { c.AllowWrites = false })
	c := client(t)
	token := login(t, c, st.srv.URL, "alice", "alice-secret")
	if _, body := get(t, c, st.srv.URL, "/deadletters/"+itoa(st.ids[0])); strings.Contains(body, `id="retry-letter"`) {
		t.Error("a read-only console shows the retry button")
	}
	for _, path := range []string{"/deadletters/retry", "/deadletters/discard"} {
		code, body := post(t, c, st.srv.URL, path, url.Values{"csrf": {token}, "id": {itoa(st.ids[0])}, "reason": {"read-only"}})
		if code != http.StatusForbidden || !strings.Contains(body, "read-only") {
			t.Errorf("POST %s in a read-only console: %d %q, want 403", path, code, body)
		}
	}
	if n := count(t, st.db, `SELECT count(*) FROM kfn.dead_letters WHERE retry_requested_at IS NULL`); n != 3 {
		t.Errorf("%d dead letters untouched in a read-only console, want 3", n)
	}
}

func TestViewersWriteGets403(t *testing.T) {
	st := setup(t, nil)
	c := client(t)
	token := login(t, c, st.srv.URL, "victor", "victor-secret")
	for _, path := range []string{"/deadletters/retry", "/deadletters/discard", "/replay"} {
		code, body := post(t, c, st.srv.URL, path, url.Values{"csrf": {token}, "id": {itoa(st.ids[0])}, "reason": {"viewer"},
			"function": {"orders"}, "topic": {"orders"}, "from": {"0"}})
		if code != http.StatusForbidden || !strings.Contains(body, "viewer role") {
			t.Errorf("viewer's POST %s: %d %q, want 403", path, code, body)
		}
	}
	if n := count(t, st.db, `SELECT count(*) FROM kfn.dead_letters`); n != 3 {
		t.Errorf("%d dead letters after a viewer's writes, want 3", n)
	}
}

func TestWriterRetriesAndDiscardsAGroupAuditedAsTheConsoleUser(t *testing.T) {
	st := setup(t, nil)
	c := client(t)
	token := login(t, c, st.srv.URL, "alice", "alice-secret")
	_, body := get(t, c, st.srv.URL, "/deadletters")
	// The two "order N not found" letters are one group.
	if !strings.Contains(body, "order &lt;n&gt; not found") || !regexp.MustCompile(`order &lt;n&gt; not found</a><br><span class="small">newest: order 97 not found</span></td>\s*<td class="num">2</td>`).MatchString(body) {
		t.Fatalf("no group of 2 for the order N not found letters:\n%s", body)
	}
	code, body := post(t, c, st.srv.URL, "/deadletters/retry", url.Values{"csrf": {token}, "id": {itoa(st.ids[2])}, "reason": {"INC-7 fixed"}})
	if code != http.StatusOK || !strings.Contains(body, "marked for retry") {
		t.Fatalf("retry: %d\n%s", code, body)
	}
	code, body = post(t, c, st.srv.URL, "/deadletters/discard", url.Values{"csrf": {token}, "function": {"orders"}, "dead_reason": {"handler_error"},
		"fp": {"order <n> not found"}, "reason": {"INC-8: orders deleted upstream"}})
	if code != http.StatusOK || !strings.Contains(body, "Discarded 2 dead letters") {
		t.Fatalf("discard the group: %d\n%s", code, body)
	}
	if n := count(t, st.db, `SELECT count(*) FROM kfn.dead_letters WHERE id = ANY($1)`, st.ids[:2]); n != 0 {
		t.Errorf("%d letters of the discarded group left", n)
	}
	if n := count(t, st.db, `SELECT count(*) FROM kfn.audit_log WHERE actor = 'console:alice' AND action = 'discard'`); n != 2 {
		t.Errorf("%d discard rows by console:alice, want 2", n)
	}
	if n := count(t, st.db, `SELECT count(*) FROM kfn.audit_log WHERE actor = 'console:alice' AND action = 'dlq_retry_requested'`); n != 1 {
		t.Errorf("%d retry rows by console:alice, want 1", n)
	}
	_, body = get(t, c, st.srv.URL, "/audit?actor=console:alice")
	if strings.Count(body, `<td class="actor">console:alice</td>`) != 3 {
		t.Errorf("the audit page does not list alice's 3 actions:\n%s", body)
	}
	// A write without a reason is refused and changes nothing.
	if code, _ := post(t, c, st.srv.URL, "/deadletters/discard", url.Values{"csrf": {token}, "id": {itoa(st.ids[2])}}); code != http.StatusBadRequest {
		t.Errorf("discard without a reason: %d, want 400", code)
	}
}

func TestEveryResponseCarriesTheSecurityHeadersAndStrictCookies(t *testing.T) {
	st := setup(t, func(c *Config) { c.TLS = true })
	res, err := http.Get(st.srv.URL + "/login")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	csp := res.Header.Get("Content-Security-Policy")
	for _, want := range []string{"default-src 'none'", "script-src 'self'", "style-src 'self'", "frame-ancestors 'none'"} {
		if !strings.Contains(csp, want) {
			t.Errorf("CSP %q lacks %q", csp, want)
		}
	}
	if strings.Contains(csp, "unsafe-inline") {
		t.Errorf("CSP allows inline code: %q", csp)
	}
	if res.Header.Get("X-Content-Type-Options") != "nosniff" || res.Header.Get("X-Frame-Options") != "DENY" {
		t.Errorf("headers: %v", res.Header)
	}
	cookies := res.Cookies()
	if len(cookies) == 0 {
		t.Fatal("the login page set no cookie")
	}
	for _, ck := range cookies {
		if !ck.HttpOnly || !ck.Secure || ck.SameSite != http.SameSiteStrictMode {
			t.Errorf("cookie %s: HttpOnly %v Secure %v SameSite %v", ck.Name, ck.HttpOnly, ck.Secure, ck.SameSite)
		}
	}
	// No template holds an inline script, style or event handler.
	entries, _ := templateFS.ReadDir("templates")
	inline := regexp.MustCompile(`(?i)<script>|<script[^>]*>[^<]|<style|\sstyle=|\son[a-z]+=`)
	for _, e := range entries {
		b, _ := templateFS.ReadFile("templates/" + e.Name())
		if loc := inline.FindIndex(b); loc != nil {
			t.Errorf("%s holds inline code: %q", e.Name(), b[loc[0]:loc[1]])
		}
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

func sha256Hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

func TestDeadLetterGroupsNormaliseNumbersAndIDs(t *testing.T) {
	db := kfntest.Postgres(t)
	dlqtest.Seed(t, db.Pool,
		dlqtest.Letter{Function: "pay", Topic: "pay", Offset: 1, Reason: "handler_error", Error: "charge 550e8400-e29b-41d4-a716-446655440000 failed: HTTP 502 after 3 tries (req a1b2c3d4e5)"},
		dlqtest.Letter{Function: "pay", Topic: "pay", Offset: 2, Reason: "handler_error", Error: "charge 123e4567-e89b-12d3-a456-426614174000 failed: HTTP 503 after 12 tries (req 9f8e7d6c)"},
		dlqtest.Letter{Function: "pay", Topic: "pay", Offset: 3, Reason: "permanent", Error: "charge 123e4567-e89b-12d3-a456-426614174000 failed: HTTP 503 after 12 tries (req 9f8e7d6c)"},
		dlqtest.Letter{Function: "pay", Topic: "pay", Offset: 4, Reason: "handler_error", Error: "utf8 decoder: bad input"},
	)
	groups, err := operator.DeadLetterGroups(context.Background(), db.Pool, "pay", operator.Page{})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, g := range groups {
		got[g.Reason+" | "+g.Fingerprint] = g.Count
	}
	want := map[string]int64{
		"handler_error | charge <id> failed: HTTP <n> after <n> tries (req <n>)": 2,
		"permanent | charge <id> failed: HTTP <n> after <n> tries (req <n>)":     1,
		"handler_error | utf8 decoder: bad input":                                1,
	}
	if len(got) != len(want) {
		t.Fatalf("groups %v, want %v", got, want)
	}
	for k, n := range want {
		if got[k] != n {
			t.Errorf("group %q: %d letters, want %d (groups: %v)", k, got[k], n, got)
		}
	}
	ids, err := operator.DeadLetterGroupIDs(context.Background(), db.Pool, "pay", "handler_error", "charge <id> failed: HTTP <n> after <n> tries (req <n>)", operator.Page{})
	if err != nil || len(ids) != 2 {
		t.Fatalf("the group's ids: %v, %v; want 2", ids, err)
	}
}

func TestAMissingPrivilegeNamesTheOperatorRole(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	role := fmt.Sprintf("console_noaccess_%d", time.Now().UnixNano())
	if _, err := db.Pool.Exec(ctx, `CREATE ROLE `+role+` NOLOGIN; GRANT USAGE ON SCHEMA kfn TO `+role); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		db.Pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) //nolint:errcheck // the database is dropped too
	})
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error { _, err := c.Exec(ctx, `SET ROLE `+role); return err }
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s, err := New(Config{Pool: pool, ProxyHeader: "X-Forwarded-User"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/deadletters", nil)
	req.Header.Set("X-Forwarded-User", "alice")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if !strings.Contains(string(body), "lacks a privilege") || !strings.Contains(string(body), "kfn_operator") {
		t.Fatalf("the dead letters page as a role without SELECT: %d\n%s", res.StatusCode, body)
	}
}
