package console

import (
	"fmt"
	"net/http"
	"testing"
	"time"
)

// clock is a limiter's injected time, moved by hand.
type clock struct{ t time.Time }

func (c *clock) now() time.Time          { return c.t }
func (c *clock) advance(d time.Duration) { c.t = c.t.Add(d) }

func limiterAt(c *clock) *loginLimiter {
	l := newLoginLimiter()
	l.now = c.now
	return l
}

// try is one login attempt of user from addr with a secret that is right
// or wrong; it reports whether the secret was checked at all.
func try(l *loginLimiter, user, addr string, right bool) (res attemptResult, checked bool) {
	res = l.attempt(user, addr, func() bool { checked = true; return right })
	return res, checked
}

func TestLoginLimiterLocksAUserOutAndLetsTheRightSecretInOnceTheLockoutIsOver(t *testing.T) {
	c := &clock{t: time.Unix(1_700_000_000, 0)}
	l := limiterAt(c)
	for i := 1; i <= userFailures; i++ {
		res, checked := try(l, "alice", "192.0.2.1", false)
		if !checked || res.OK || res.RetryAfter != 0 {
			t.Fatalf("failure %d: %+v, checked %v; want a checked failure", i, res, checked)
		}
		if locked := len(res.Lockouts) == 1; locked != (i == userFailures) {
			t.Fatalf("failure %d: lockouts %+v", i, res.Lockouts)
		}
	}
	// Locked out: the right secret is not even checked.
	res, checked := try(l, "alice", "192.0.2.1", true)
	if checked || res.OK || res.RetryAfter != firstLockout {
		t.Fatalf("the right secret while locked out: %+v, checked %v; want refused unchecked for %s", res, checked, firstLockout)
	}
	// From another address too: the lockout is the name's.
	if res, checked := try(l, "alice", "198.51.100.7", true); checked || res.RetryAfter == 0 {
		t.Fatalf("the right secret from another address while alice is locked out: %+v, checked %v", res, checked)
	}
	c.advance(firstLockout - time.Second)
	if res, _ := try(l, "alice", "192.0.2.1", true); res.RetryAfter != time.Second {
		t.Fatalf("a second before the lockout ends: %+v, want 1s left", res)
	}
	c.advance(time.Second)
	if res, checked := try(l, "alice", "192.0.2.1", true); !checked || !res.OK {
		t.Fatalf("the right secret once the lockout is over: %+v, checked %v", res, checked)
	}
}

// lockedOut is a limiter at a clock of its own with user locked out.
func lockedOut(user string) (*clock, *loginLimiter) {
	c := &clock{t: time.Unix(1_700_000_000, 0)}
	l := limiterAt(c)
	for range userFailures {
		try(l, user, "192.0.2.1", false)
	}
	return c, l
}

func TestLoginLimiterLockoutsDoubleUpToTheCapAndASuccessResetsThem(t *testing.T) {
	c, l := lockedOut("bob")
	// Each failure after a lockout locks again, for twice as long, up to
	// the cap.
	want := []time.Duration{2 * time.Minute, 4 * time.Minute, 8 * time.Minute, 16 * time.Minute, maxLockout, maxLockout}
	wait := firstLockout
	for i, d := range want {
		c.advance(wait)
		res, checked := try(l, "bob", fmt.Sprintf("203.0.113.%d", i), false)
		if !checked || len(res.Lockouts) != 1 || res.Lockouts[0].For != d || res.Lockouts[0].Nth != i+2 {
			t.Fatalf("the first failure after lockout %d: %+v, checked %v; want lockout %d for %s", i+1, res, checked, i+2, d)
		}
		wait = d
	}
	// A success forgets the name's failures: four more do not lock it.
	c.advance(wait)
	if res, _ := try(l, "bob", "192.0.2.9", true); !res.OK {
		t.Fatalf("the right secret after the last lockout: %+v", res)
	}
	for i := 1; i < userFailures; i++ {
		if res, _ := try(l, "bob", "192.0.2.9", false); len(res.Lockouts) != 0 {
			t.Fatalf("failure %d after a success: locked out again (%+v)", i, res.Lockouts)
		}
	}
	if res, checked := try(l, "bob", "192.0.2.9", true); !checked || !res.OK {
		t.Fatalf("the right secret after four failures: %+v", res)
	}
}

func TestLoginLimiterLocksAnAddressThatGuessesManyNames(t *testing.T) {
	c := &clock{t: time.Unix(1_700_000_000, 0)}
	l := limiterAt(c)
	for i := 1; i <= addressFailures; i++ {
		res, _ := try(l, fmt.Sprintf("user-%d", i), "192.0.2.66", false)
		if locked := len(res.Lockouts) == 1 && res.Lockouts[0].Kind == "address"; locked != (i == addressFailures) {
			t.Fatalf("failure %d: lockouts %+v", i, res.Lockouts)
		}
	}
	if res, checked := try(l, "carol", "192.0.2.66", true); checked || res.RetryAfter != firstLockout {
		t.Fatalf("a fresh name from the locked-out address: %+v, checked %v", res, checked)
	}
	if res, checked := try(l, "carol", "192.0.2.67", true); !checked || !res.OK {
		t.Fatalf("carol from another address: %+v, checked %v", res, checked)
	}
}

func TestLoginLimiterStaysBoundedUnderASprayOfNamesAndAddresses(t *testing.T) {
	_, l := lockedOut("alice")
	// Three times the table's size of fresh names, each from a fresh
	// address, within one window.
	for i := range 3 * maxTracked {
		try(l, fmt.Sprintf("spray-%d", i), fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255), false)
	}
	if users, addrs := len(l.users.byKey), len(l.addrs.byKey); users > maxTracked || addrs > maxTracked {
		t.Fatalf("after a spray of %d names: %d names and %d addresses tracked, want at most %d each", 3*maxTracked, users, addrs, maxTracked)
	}
	if n := l.users.open.Len() + l.users.locked.Len(); n != len(l.users.byKey) {
		t.Fatalf("the lists hold %d names, the map %d", n, len(l.users.byKey))
	}
	// The spray did not evict alice's lockout.
	if res, checked := try(l, "alice", "192.0.2.200", true); checked || res.RetryAfter == 0 {
		t.Fatalf("alice after the spray: %+v, checked %v; want still locked out", res, checked)
	}
}

func TestLoginsCountAgainstThePeerAddressOrTheHeaderTheConsoleIsTold(t *testing.T) {
	for _, c := range []struct{ header, remote, forwarded, want string }{
		{"", "192.0.2.1:5555", "203.0.113.9", "192.0.2.1"},
		{"", "[2001:db8:1:2:3:4:5:6]:443", "", "2001:db8:1:2::/64"},
		{"", "[2001:db8:1:2:ffff::1]:443", "", "2001:db8:1:2::/64"},
		{"", "[::ffff:192.0.2.1]:80", "", "192.0.2.1"},
		// Told: the last entry, which the nearest proxy appended.
		{"X-Forwarded-For", "10.0.0.2:80", "203.0.113.9, 198.51.100.2", "198.51.100.2"},
		{"X-Forwarded-For", "10.0.0.2:80", "2001:db8:9::1", "2001:db8:9::/64"},
		{"X-Forwarded-For", "10.0.0.2:80", "", "10.0.0.2"},
		{"X-Forwarded-For", "10.0.0.2:80", "198.51.100.2, not-an-address", "10.0.0.2"},
	} {
		r, _ := http.NewRequest(http.MethodPost, "/login", nil)
		r.RemoteAddr = c.remote
		if c.forwarded != "" {
			r.Header.Set("X-Forwarded-For", c.forwarded)
		}
		if got := clientAddress(r, c.header); got != c.want {
			t.Errorf("told %q, peer %s, X-Forwarded-For %q: counted against %q, want %q", c.header, c.remote, c.forwarded, got, c.want)
		}
	}
}
