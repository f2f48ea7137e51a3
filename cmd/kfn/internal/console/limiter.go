package console

import (
	"container/list"
	"crypto/sha256"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"time"
)

// The login limits. A user name is locked out after userFailures failed
// logins inside loginWindow, a client address after addressFailures (an
// address may be a NAT or a proxy many people share). A lockout lasts
// firstLockout, and each next one of the same name or address twice the
// one before, up to maxLockout; once a lockout is over, the next failure
// locks again. A name or address is forgotten maxLockout after its last
// lockout ended (or a window after its first failure, when it was never
// locked out). Each of the two tables holds at most maxTracked entries.
const (
	loginWindow     = 15 * time.Minute
	userFailures    = 5
	addressFailures = 20
	firstLockout    = time.Minute
	maxLockout      = 30 * time.Minute
	maxTracked      = 10_000
)

// loginLimiter counts the failed logins of each user name and of each
// client address, and locks a name or an address out once it has failed
// too often. The password check runs under its lock (attempt), so
// parallel guesses cannot all pass the check before the first failure is
// counted. The zero value is not usable; use newLoginLimiter.
type loginLimiter struct {
	mu    sync.Mutex
	now   func() time.Time
	users failureTable
	addrs failureTable
}

func newLoginLimiter() *loginLimiter {
	return &loginLimiter{now: time.Now, users: newFailureTable(maxTracked), addrs: newFailureTable(maxTracked)}
}

// lockout is a name or address just locked out, for the log.
type lockout struct {
	Kind     string // "user" or "address"
	Name     string
	Failures int           // failed logins that led to it
	For      time.Duration // how long it lasts
	Nth      int           // the name's or address's lockouts so far, this one included
}

// attemptResult is what attempt says about one login.
type attemptResult struct {
	OK         bool          // the check passed
	RetryAfter time.Duration // > 0: locked out, the check did not run
	Lockouts   []lockout     // locked out by this failure
}

// attempt runs check (the secret's check) for user from addr unless either
// is locked out, and counts a failure against both or, on success, forgets
// the user's failures (not the address's: one good account must not wipe
// an address's guesses at the others).
func (l *loginLimiter) attempt(user, addr string, check func() bool) attemptResult {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	userKey := keyOf(user)
	if wait := max(l.users.lockedFor(userKey, now), l.addrs.lockedFor(addr, now)); wait > 0 {
		return attemptResult{RetryAfter: wait}
	}
	if check() {
		l.users.forget(userKey)
		return attemptResult{OK: true}
	}
	var res attemptResult
	if lo, ok := l.users.fail(userKey, now, userFailures); ok {
		lo.Kind, lo.Name = "user", shortened(user)
		res.Lockouts = append(res.Lockouts, lo)
	}
	if lo, ok := l.addrs.fail(addr, now, addressFailures); ok {
		lo.Kind, lo.Name = "address", addr
		res.Lockouts = append(res.Lockouts, lo)
	}
	return res
}

// shortened is a name for the log: at most 64 bytes of it.
func shortened(name string) string {
	if len(name) > 64 {
		return name[:64] + "…"
	}
	return name
}

// keyOf is a user name's key in the table: its SHA-256, so that a name
// of any length costs the same memory.
func keyOf(name string) string {
	sum := sha256.Sum256([]byte(name))
	return string(sum[:])
}

// clientAddress is the address a login counts against: the TCP peer's,
// or, when the console is told the header its reverse proxy sets
// (Config.ClientAddressHeader), the last address in that header, the one
// the nearest proxy wrote (one the header does not hold as an address
// leaves the peer's). Never a header it was not told of: a client writes
// X-Forwarded-For as it likes. An IPv6 address counts by its /64, which
// one host usually has whole.
func clientAddress(r *http.Request, header string) string {
	if header != "" {
		values := r.Header.Values(header)
		if len(values) > 0 {
			entries := strings.Split(values[len(values)-1], ",")
			if a, err := netip.ParseAddr(strings.TrimSpace(entries[len(entries)-1])); err == nil {
				return addressKey(a)
			}
		}
	}
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return addressKey(ap.Addr())
}

// addressKey is a's key in the address table: an IPv6 address's /64.
func addressKey(a netip.Addr) string {
	a = a.Unmap()
	if a.Is6() {
		p, _ := a.Prefix(64)
		return p.String()
	}
	return a.String()
}

// failureTable is the failures of each key (a user name's hash or an
// address), at most limit keys. It evicts the key whose last failure is
// oldest among those not locked out, and a locked-out key only when every
// key is locked out, so a spray of fresh names or addresses cannot free a
// locked-out one.
type failureTable struct {
	limit  int
	byKey  map[string]*list.Element // of *failures, in open or locked
	open   list.List                // not locked out, the latest failure first
	locked list.List                // locked out at least once, the latest lockout first
}

type failures struct {
	key         string
	count       int       // failures since first
	first       time.Time // the start of the window count is in
	lockouts    int
	lockedUntil time.Time
}

func newFailureTable(limit int) failureTable {
	return failureTable{limit: limit, byKey: map[string]*list.Element{}}
}

// lockedFor is how long key stays locked out; 0 when it is not.
func (t *failureTable) lockedFor(key string, now time.Time) time.Duration {
	if e, ok := t.byKey[key]; ok {
		if f := e.Value.(*failures); now.Before(f.lockedUntil) {
			return f.lockedUntil.Sub(now)
		}
	}
	return 0
}

// stale says f can be forgotten: its window is over and so is the time a
// lockout is remembered.
func (f *failures) stale(now time.Time) bool {
	return now.After(f.first.Add(loginWindow)) && (f.lockouts == 0 || now.After(f.lockedUntil.Add(maxLockout)))
}

// fail counts a failure of key; at the limit-th failure of a window it
// locks key out and returns the lockout.
func (t *failureTable) fail(key string, now time.Time, limit int) (lockout, bool) {
	e, ok := t.byKey[key]
	if ok && e.Value.(*failures).stale(now) {
		t.forget(key)
		ok = false
	}
	if !ok {
		t.makeRoom(now)
		e = t.open.PushFront(&failures{key: key, first: now})
		t.byKey[key] = e
	}
	f := e.Value.(*failures)
	if now.After(f.first.Add(loginWindow)) {
		f.count, f.first = 0, now
	}
	f.count++
	if f.count < limit {
		if f.lockouts == 0 {
			t.open.MoveToFront(e)
		}
		return lockout{}, false
	}
	f.lockouts++
	d := min(firstLockout<<min(f.lockouts-1, 16), maxLockout)
	f.lockedUntil = now.Add(d)
	// The window restarts when the lockout ends, one failure short of
	// the limit: the first failure after it locks again, for longer.
	f.first, f.count = f.lockedUntil, limit-1
	if f.lockouts == 1 {
		t.open.Remove(e)
		e = t.locked.PushFront(f)
		t.byKey[key] = e
	} else {
		t.locked.MoveToFront(e)
	}
	return lockout{Failures: limit, For: d, Nth: f.lockouts}, true
}

// forget drops key's failures.
func (t *failureTable) forget(key string) {
	e, ok := t.byKey[key]
	if !ok {
		return
	}
	delete(t.byKey, key)
	if e.Value.(*failures).lockouts == 0 {
		t.open.Remove(e)
	} else {
		t.locked.Remove(e)
	}
}

// makeRoom makes room for one more key: it drops the oldest stale keys,
// then, when the table is still full, the oldest key not locked out, or
// else the oldest locked-out one.
func (t *failureTable) makeRoom(now time.Time) {
	for _, l := range []*list.List{&t.open, &t.locked} {
		for e := l.Back(); e != nil && e.Value.(*failures).stale(now); e = l.Back() {
			t.forget(e.Value.(*failures).key)
		}
	}
	if len(t.byKey) < t.limit {
		return
	}
	oldest := t.open.Back()
	if oldest == nil {
		oldest = t.locked.Back()
	}
	t.forget(oldest.Value.(*failures).key)
}
