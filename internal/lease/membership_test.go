package lease

import (
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A listing of the members that began before a member left, but reaches
// the loop after the watch has shown the departure, must not bring that
// member back. It would move the items the others took over back to it,
// and once the next listing dropped it, they would be taken again under
// new tokens: a handoff twice over. The container test's clean stop
// measured such a handoff at 1.36 s instead of about 0.1 s, on a machine
// where the lease round trips took up to 0.2 s.
func TestMembershipListingBegunBeforeADepartureDoesNotUndoIt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tr := newTracker()
	defer tr.check(t)
	items := itemsOf(6)

	// A's next listing that still holds B is kept from A's loop until
	// the test lets it through.
	a := newManager(t, connect(t, b.nats.URL), testManagerConfig("A"))
	var holding atomic.Bool
	held := make(chan []string, 1)
	release := make(chan struct{})
	var releaseOnce sync.Once
	letGo := func() { releaseOnce.Do(func() { close(release) }) }
	defer letGo()
	a.onListed = func(members []string) {
		if slices.Contains(members, "B") && holding.CompareAndSwap(true, false) {
			held <- members
			<-release
		}
	}
	stopA := runMember(t, a, items, tr)
	defer stopA()
	stopB := runMember(t, newManager(t, connect(t, b.nats.URL), testManagerConfig("B")), items, tr)
	want := Assign([]string{"A", "B"}, names("orders/", 6))
	waitFor(t, livenessBound, "A and B to own their shares", func() bool { return maps.Equal(tr.owners(), want) })

	holding.Store(true)
	var stale []string
	select {
	case stale = <-held:
	case <-time.After(livenessBound):
		t.Fatal("A listed no members within the liveness bound")
	}
	stopB() // B leaves and releases its leases; A's watch shows both
	took := waitFor(t, livenessBound, "A to take B's items", func() bool { return tr.ownsAll("A", 6) })
	tokens := tr.tokens()
	letGo()                   // the listing begun before B left: A's loop gets it now
	time.Sleep(4 * testRenew) // and fresh listings after it
	t.Logf("A took B's items %v after B stopped; then got the listing %v begun before", took, stale)
	if after := tr.tokens(); !tr.ownsAll("A", 6) || !maps.Equal(after, tokens) {
		t.Errorf("after the listing begun before B left, A owns %v with tokens %v; want all 6 items still under the tokens %v it took them with", tr.owners(), after, tokens)
	}
}

// A heartbeat older than the bucket's MaxAge allows is a replica's stale
// copy, not a live member: after a whole NATS cluster restarted under
// load, a member killed two minutes before kept coming and going from the
// listings, and its lanes were handed to it again and again. The store's
// clock is moved forward here, so that heartbeats written now are as old
// as that stale copy was (the bucket's TTL is long, so the server does not
// expire them meanwhile).
func TestMembersLeaveOutAHeartbeatTheBucketShouldHaveExpired(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	const ttl = 30 * time.Second
	store, err := OpenStore(ctx, b.js, StoreConfig{Bucket: "test_leases_30s", TTL: ttl, SafetyMargin: SafetyMarginFor(ttl), Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"A", "B"} {
		if err := store.Heartbeat(ctx, "fn.orders", id); err != nil {
			t.Fatal(err)
		}
	}
	check := func(when string, want []string) {
		t.Helper()
		members, err := store.Members(ctx, "fn.orders")
		if err != nil {
			t.Fatal(err)
		}
		present, err := store.memberPresent(ctx, "fn.orders", "A")
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(members, want) || present != slices.Contains(want, "A") {
			t.Errorf("%s: listed %v, A present %v; want %v", when, members, present, want)
		}
	}
	check("fresh heartbeats", []string{"A", "B"})
	store.now = func() time.Time { return time.Now().Add(2*ttl + outlivedSkew - 5*time.Second) }
	check("heartbeats just inside the allowance", []string{"A", "B"})
	store.now = func() time.Time { return time.Now().Add(2*ttl + outlivedSkew + 5*time.Second) }
	check("heartbeats the bucket should have expired", nil)
}
