package lease

import (
	"regexp"
	"testing"
)

func TestEscapeTokenRoundTripsAndIsOneToken(t *testing.T) {
	valid := regexp.MustCompile(`^[-/=_a-zA-Z0-9]+$`)
	names := []string{"orders/3", "a.b", "a_b", "a_2Eb", "members", "ünï code", "x y*>", "-", "=", "__", "_5F"}
	seen := map[string]string{}
	for _, n := range names {
		tok := escapeToken(n)
		if !valid.MatchString(tok) {
			t.Errorf("escapeToken(%q) = %q: not a single valid KV token", n, tok)
		}
		back, err := unescapeToken(tok)
		if err != nil || back != n {
			t.Errorf("unescapeToken(%q) = %q, %v; want %q", tok, back, err, n)
		}
		if prev, dup := seen[tok]; dup {
			t.Errorf("%q and %q both escape to %q", prev, n, tok)
		}
		seen[tok] = n
	}
	if got := escapeToken("orders/3"); got != "orders/3" {
		t.Errorf("escapeToken(orders/3) = %q, want it unchanged", got)
	}
}

func TestKeysSplitBackAndDoNotCollide(t *testing.T) {
	// A group named "members" must not see heartbeat keys as leases.
	if _, ok := splitLeaseKey("members", memberKey("x", "m1")); ok {
		t.Error("a heartbeat key parsed as a lease key of group \"members\"")
	}
	if item, ok := splitLeaseKey("fn.orders", leaseKey("fn.orders", "p.7")); !ok || item != "p.7" {
		t.Errorf("splitLeaseKey = %q, %v; want p.7", item, ok)
	}
	if id, ok := splitMemberKey("g", memberKey("g", "host_1.a")); !ok || id != "host_1.a" {
		t.Errorf("splitMemberKey = %q, %v; want host_1.a", id, ok)
	}
	if _, ok := splitMemberKey("g", memberKey("g2", "m")); ok {
		t.Error("a heartbeat of group g2 parsed as one of group g")
	}
}
