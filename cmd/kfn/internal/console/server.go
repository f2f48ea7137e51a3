package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/repeatlog"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Config is what the console serves from and how it lets people in.
type Config struct {
	// Pool is --database-url's database, where the functions with no
	// database of their own keep their kfn tables; nil when every
	// function has its own.
	Pool *pgxpool.Pool
	// FunctionPools are the functions with a database of their own
	// (--function-databases): the pages and actions of such a function
	// use its pool. One pool may serve several functions.
	FunctionPools map[string]*pgxpool.Pool
	// JS reaches NATS: the lease holders on the overview, and replays
	// (which take the partition's lease). Nil: no lease holders, no replay.
	JS jetstream.JetStream
	// KafkaBrokers and KafkaSecurity give the lag and check replays.
	KafkaBrokers  []string
	KafkaSecurity runtime.KafkaSecurity
	LeaseBucket   string
	EventStream   string // for verify; default outbox.DefaultStream

	// Users come from an auth file; ProxyHeader names the header an auth
	// proxy sets to the user's name instead. Exactly one is required.
	Users       []User
	ProxyHeader string
	// ProxyWriters are the proxy users with the writer role.
	ProxyWriters []string
	// ClientAddressHeader names the header a reverse proxy in front of an
	// auth-file console sets to the client's address, which the login
	// limits then count against instead of the proxy's; "" counts the TCP
	// peer's.
	ClientAddressHeader string
	// AllowWrites lets writers retry, discard and replay.
	AllowWrites bool
	// TLS says the console is served over TLS: its cookies are Secure.
	TLS bool
	// PageSize is how many rows a page of a list shows (dead letter
	// groups, a group's letters, parked keys, the audit log); default
	// DefaultPageSize.
	PageSize int
	Log      *slog.Logger
}

// ErrNoAuth refuses a console that would let anyone in.
var ErrNoAuth = errors.New("the console needs authentication: give --auth-file, or --trust-proxy-header when an auth proxy in front of it sets the user's name")

// Server is the console's HTTP handler.
type Server struct {
	cfg      Config
	mux      *http.ServeMux
	pages    map[string]*template.Template
	secret   []byte // signs CSRF tokens
	sessions sessions
	statuses []*operator.StatusReader // one per database, as in databases()
	rates    rates
	logins   *loginLimiter
	lockouts *repeatlog.Log // one line per lockout, fewer when many come at once
}

// New checks cfg and makes the console.
func New(cfg Config) (*Server, error) {
	switch {
	case len(cfg.Users) == 0 && cfg.ProxyHeader == "":
		return nil, ErrNoAuth
	case len(cfg.Users) > 0 && cfg.ProxyHeader != "":
		return nil, errors.New("--auth-file and --trust-proxy-header exclude each other: pick how users are known")
	case cfg.Pool == nil && len(cfg.FunctionPools) == 0:
		return nil, errors.New("the console needs a database")
	}
	if cfg.EventStream == "" {
		cfg.EventStream = outbox.DefaultStream
	}
	if cfg.PageSize <= 0 {
		cfg.PageSize = DefaultPageSize
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	s := &Server{cfg: cfg, mux: http.NewServeMux(), secret: make([]byte, 32), sessions: sessions{byID: map[string]session{}},
		logins: newLoginLimiter(), lockouts: repeatlog.New()}
	if _, err := rand.Read(s.secret); err != nil {
		return nil, err
	}
	pages, err := parsePages()
	if err != nil {
		return nil, err
	}
	s.pages = pages
	for _, pool := range s.databases() {
		s.statuses = append(s.statuses, operator.NewStatusReaderSecure(pool, cfg.KafkaBrokers, cfg.KafkaSecurity, cfg.JS, cfg.LeaseBucket))
	}
	s.routes()
	return s, nil
}

// Close closes the status readers' Kafka connections.
func (s *Server) Close() {
	for _, r := range s.statuses {
		r.Close()
	}
}

func (s *Server) routes() {
	static, _ := fs.Sub(staticFS, "static")
	s.mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	s.mux.HandleFunc("GET /favicon.ico", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) })
	s.mux.HandleFunc("GET /login", s.loginPage)
	s.mux.HandleFunc("POST /login", s.login)
	s.mux.Handle("POST /logout", s.authed(s.post(s.logout)))
	s.mux.Handle("GET /{$}", s.authed(http.HandlerFunc(s.overview)))
	s.mux.Handle("GET /overview/live", s.authed(http.HandlerFunc(s.overviewLive)))
	s.mux.Handle("GET /deadletters", s.authed(http.HandlerFunc(s.deadLetterGroups)))
	s.mux.Handle("GET /deadletters/group", s.authed(http.HandlerFunc(s.deadLetterGroup)))
	s.mux.Handle("GET /deadletters/{id}", s.authed(http.HandlerFunc(s.deadLetter)))
	s.mux.Handle("POST /deadletters/retry", s.authed(s.write(s.retry)))
	s.mux.Handle("POST /deadletters/discard", s.authed(s.write(s.discard)))
	s.mux.Handle("GET /parked", s.authed(http.HandlerFunc(s.parkedKeys)))
	s.mux.Handle("GET /replay", s.authed(http.HandlerFunc(s.replayForm)))
	s.mux.Handle("POST /replay", s.authed(s.write(s.replay)))
	s.mux.Handle("GET /audit", s.authed(http.HandlerFunc(s.audit)))
	s.mux.Handle("GET /verify", s.authed(http.HandlerFunc(s.verify)))
}

// ServeHTTP sets the security headers on every response and serves r.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "+
		"form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-store")
	if s.cfg.TLS {
		h.Set("Strict-Transport-Security", "max-age=31536000")
	}
	s.mux.ServeHTTP(w, r)
}

// identity is who makes a request.
type identity struct {
	User      string
	Role      string
	SessionID string // "" behind an auth proxy
}

// Actor is the name the audit log gets for the user's actions.
func (id identity) Actor() string { return "console:" + id.User }

type ctxKey struct{}

func who(r *http.Request) identity { id, _ := r.Context().Value(ctxKey{}).(identity); return id }

// authed lets a request through only with an identity: a session cookie
// (auth file) or the trusted proxy header. Without one it answers 401: the
// login page for an auth file.
func (s *Server) authed(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, ok := s.identify(r)
		if !ok {
			if s.cfg.ProxyHeader != "" {
				http.Error(w, "401 unauthorized: no "+s.cfg.ProxyHeader+" header from the auth proxy", http.StatusUnauthorized)
				return
			}
			s.renderLogin(w, r, http.StatusUnauthorized, "")
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), ctxKey{}, id)))
	})
}

func (s *Server) identify(r *http.Request) (identity, bool) {
	if s.cfg.ProxyHeader != "" {
		name := strings.TrimSpace(r.Header.Get(s.cfg.ProxyHeader))
		if name == "" {
			return identity{}, false
		}
		role := RoleViewer
		for _, w := range s.cfg.ProxyWriters {
			if w == name {
				role = RoleWriter
			}
		}
		return identity{User: name, Role: role}, true
	}
	c, err := r.Cookie(sessionCookie)
	if err != nil {
		return identity{}, false
	}
	sess, ok := s.sessions.get(c.Value)
	if !ok {
		return identity{}, false
	}
	return identity{User: sess.user, Role: sess.role, SessionID: c.Value}, true
}

// csrfToken is the CSRF token of id's pages: an HMAC of the session (or,
// behind a proxy, the user), so it cannot be forged without the server's
// secret and is worthless in another session.
func (s *Server) csrfToken(id identity) string {
	m := hmac.New(sha256.New, s.secret)
	fmt.Fprintf(m, "csrf\x00%s\x00%s", id.User, id.SessionID)
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// post checks the CSRF token of a POST: 403 without the right one.
func (s *Server) post(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
		got := r.PostFormValue("csrf")
		if !hmac.Equal([]byte(got), []byte(s.csrfToken(who(r)))) {
			http.Error(w, "403 forbidden: missing or wrong CSRF token (reload the page)", http.StatusForbidden)
			return
		}
		next(w, r)
	}
}

// write lets a change through only with a CSRF token, in a console
// started with writes allowed, from a user with the writer role.
func (s *Server) write(next http.HandlerFunc) http.Handler {
	return s.post(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case !s.cfg.AllowWrites:
			http.Error(w, "403 forbidden: the console is read-only (start it with --allow-writes)", http.StatusForbidden)
		case who(r).Role != RoleWriter:
			http.Error(w, "403 forbidden: "+who(r).User+" has the viewer role; writes need the writer role", http.StatusForbidden)
		default:
			next(w, r)
		}
	})
}

// page is what every page's template gets.
type page struct {
	Title     string
	Nav       string
	User      string
	Role      string
	CSRF      string
	CanWrite  bool
	ProxyAuth bool
	Error     string
	Notice    string
	Data      any
}

func (s *Server) newPage(r *http.Request, nav, title string, data any) page {
	id := who(r)
	return page{Title: title, Nav: nav, User: id.User, Role: id.Role, CSRF: s.csrfToken(id),
		CanWrite: s.cfg.AllowWrites && id.Role == RoleWriter, ProxyAuth: s.cfg.ProxyHeader != "", Data: data}
}

// render writes the page named name with status (its headers and cookies
// must be set before).
func (s *Server) render(w http.ResponseWriter, status int, name string, p page) {
	t, ok := s.pages[name]
	if !ok {
		http.Error(w, "no page "+name, http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	if err := t.ExecuteTemplate(w, name, p); err != nil {
		s.cfg.Log.Error("render", "page", name, "err", err)
	}
}

// problem turns an error into the text a page shows: a missing privilege
// says which role the console needs.
func problem(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		return "the console's database role lacks a privilege (" + pgErr.Message + "): connect it as kfn_operator (see Three roles in docs/production/postgres.md)"
	}
	return err.Error()
}

// sessions are the auth file's logged-in users, in memory: a restart logs
// everyone out.
type sessions struct {
	mu   sync.Mutex
	byID map[string]session
}

type session struct {
	user, role string
	expires    time.Time
}

const (
	sessionCookie = "kfn_console_session"
	loginCookie   = "kfn_console_login"
	sessionTTL    = 12 * time.Hour
)

func (ss *sessions) get(id string) (session, bool) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	s, ok := ss.byID[id]
	if ok && time.Now().After(s.expires) {
		delete(ss.byID, id)
		return session{}, false
	}
	return s, ok
}

func (ss *sessions) start(u User) string {
	id := randomToken()
	ss.mu.Lock()
	defer ss.mu.Unlock()
	now := time.Now()
	for k, v := range ss.byID {
		if now.After(v.expires) {
			delete(ss.byID, k)
		}
	}
	ss.byID[id] = session{user: u.Name, role: u.Role, expires: now.Add(sessionTTL)}
	return id
}

func (ss *sessions) end(id string) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	delete(ss.byID, id)
}

func randomToken() string {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	return base64.RawURLEncoding.EncodeToString(b)
}

func (s *Server) cookie(name, value string, maxAge int) *http.Cookie {
	return &http.Cookie{Name: name, Value: value, Path: "/", MaxAge: maxAge, HttpOnly: true, Secure: s.cfg.TLS, SameSite: http.SameSiteStrictMode}
}

// loginPage shows the login form with a fresh login CSRF cookie, whose
// value the form sends back (a login form is a POST too).
func (s *Server) loginPage(w http.ResponseWriter, r *http.Request) {
	if s.cfg.ProxyHeader != "" {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	s.renderLogin(w, r, http.StatusOK, "")
}

func (s *Server) renderLogin(w http.ResponseWriter, r *http.Request, status int, msg string) {
	// One token per browser: a second login page (another tab, a
	// prefetch) keeps the first one's forms valid.
	token := randomToken()
	if c, err := r.Cookie(loginCookie); err == nil && len(c.Value) == len(token) {
		token = c.Value
	}
	http.SetCookie(w, s.cookie(loginCookie, token, 600))
	next := r.URL.Path
	if r.URL.RawQuery != "" {
		next += "?" + r.URL.RawQuery
	}
	if r.Method != http.MethodGet || next == "/login" {
		next = "/"
	}
	s.render(w, status, "login", page{Title: "Log in", CSRF: token, Error: msg, Data: next})
}

func (s *Server) login(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, 16<<10)
	c, err := r.Cookie(loginCookie)
	if s.cfg.ProxyHeader != "" || err != nil || !hmac.Equal([]byte(c.Value), []byte(r.PostFormValue("csrf"))) {
		http.Error(w, "403 forbidden: missing or wrong CSRF token (reload the login page)", http.StatusForbidden)
		return
	}
	name, addr := r.PostFormValue("user"), clientAddress(r, s.cfg.ClientAddressHeader)
	var u User
	res := s.logins.attempt(name, addr, func() bool {
		var ok bool
		u, ok = authenticate(s.cfg.Users, name, r.PostFormValue("secret"))
		return ok
	})
	for _, lo := range res.Lockouts {
		s.lockouts.Failed(r.Context(), s.cfg.Log, slog.LevelWarn, "console login locked out after failed logins",
			"kind", lo.Kind, lo.Kind, lo.Name, "failures", lo.Failures, "for", lo.For, "lockout", lo.Nth)
	}
	switch {
	case res.RetryAfter > 0:
		// The same answer for a name that exists and one that does not.
		secs := int((res.RetryAfter + time.Second - 1) / time.Second)
		w.Header().Set("Retry-After", strconv.Itoa(secs))
		s.renderLogin(w, r, http.StatusTooManyRequests, fmt.Sprintf("too many failed logins: try again in %s", time.Duration(secs)*time.Second))
		return
	case !res.OK:
		s.renderLogin(w, r, http.StatusUnauthorized, "wrong user or secret")
		return
	}
	http.SetCookie(w, s.cookie(loginCookie, "", -1))
	http.SetCookie(w, s.cookie(sessionCookie, s.sessions.start(u), int(sessionTTL/time.Second)))
	s.cfg.Log.Info("console login", "user", u.Name, "role", u.Role)
	next := r.PostFormValue("next")
	if !strings.HasPrefix(next, "/") || strings.HasPrefix(next, "//") || strings.Contains(next, `\`) {
		next = "/"
	}
	http.Redirect(w, r, next, http.StatusSeeOther)
}

func (s *Server) logout(w http.ResponseWriter, r *http.Request) {
	if id := who(r); id.SessionID != "" {
		s.sessions.end(id.SessionID)
	}
	http.SetCookie(w, s.cookie(sessionCookie, "", -1))
	http.Redirect(w, r, "/login", http.StatusSeeOther)
}
