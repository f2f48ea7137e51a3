package lease

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// openTestStore opens bucket with test timing, a fixed token floor and a
// small margin, so that the arithmetic is easy to check.
func openTestStore(t *testing.T, js jetstream.JetStream, bucket string, floor func() uint64, margin uint64) *Store {
	t.Helper()
	s, err := OpenStore(testContext(t), js, StoreConfig{
		Bucket: bucket, TTL: testTTL, SafetyMargin: testMargin, Logger: testLogger(), TokenMargin: margin,
		TokenFloor: func(context.Context) (uint64, error) { return floor(), nil },
	})
	if err != nil {
		t.Fatalf("open store: %v", err)
	}
	return s
}

func fixed(n uint64) func() uint64 { return func() uint64 { return n } }

// acquireWhenQuiet acquires once the store no longer waits for the holders
// of a lost bucket.
func acquireWhenQuiet(t *testing.T, s *Store, group, item, owner string) *Lease {
	t.Helper()
	time.Sleep(time.Until(s.QuietUntil()))
	l, err := s.Acquire(testContext(t), group, item, owner)
	if err != nil {
		t.Fatalf("acquire %s/%s: %v", group, item, err)
	}
	return l
}

// The bucket's stream is laid out exactly as jetstream.CreateKeyValue lays
// out a KV bucket, apart from where its sequence starts and its metadata, so
// that every KV operation and tool treats it as a bucket.
func TestBucketStreamIsAKeyValueBucket(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	if _, err := b.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket: "plain", Description: "kfn leases and membership heartbeats (internal/lease)", History: 1,
		TTL: testTTL, Storage: jetstream.FileStorage, LimitMarkerTTL: testTTL,
	}); err != nil {
		t.Fatal(err)
	}
	plain, err := b.js.Stream(ctx, "KV_plain")
	if err != nil {
		t.Fatal(err)
	}
	ours, err := b.js.Stream(ctx, "KV_test_leases")
	if err != nil {
		t.Fatal(err)
	}
	want, got := plain.CachedInfo().Config, ours.CachedInfo().Config
	if got.FirstSeq <= DefaultTokenMargin {
		t.Errorf("first sequence %d; want above the margin %d", got.FirstSeq, DefaultTokenMargin)
	}
	for _, c := range []*jetstream.StreamConfig{&want, &got} {
		c.Name, c.Subjects, c.FirstSeq, c.Metadata = "", nil, 0, nil
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("lease bucket stream config differs from a KV bucket's:\n got %+v\nwant %+v", got, want)
	}
}

// A new bucket's tokens start above the floor plus the margin, and the base
// is recorded in the bucket.
func TestNewBucketTokensStartAboveTheFloor(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	start := time.Now()
	s := openTestStore(t, b.js, "floored", fixed(1_000_000), 1000)
	// The floor says tokens were used before, so the bucket may replace a
	// lost one: the store waits until the lost leases have run out.
	if waited := time.Since(start); waited < testTTL-testMargin {
		t.Errorf("the bucket was created %v after opening; want a wait of TTL-SafetyMargin (%v)", waited, testTTL-testMargin)
	}
	base, err := s.TokenBase(ctx)
	if err != nil || base != 1_001_000 {
		t.Fatalf("token base = %d, %v; want 1001000", base, err)
	}
	l, err := s.Acquire(ctx, "g", "0", "A")
	if err != nil {
		t.Fatal(err)
	}
	if l.Token != base+1 {
		t.Errorf("first token %d; want base+1 = %d", l.Token, base+1)
	}
	// Another store opening the bucket does not create it again: the floor
	// only matters at creation.
	other := openTestStore(t, b.js, "floored", fixed(5_000_000), 1000)
	if base2, _ := other.TokenBase(ctx); base2 != base {
		t.Errorf("a second store sees base %d; want %d", base2, base)
	}
	l2, err := other.Acquire(ctx, "g", "1", "B") // it did not see a loss: no wait
	if err != nil || l2.Token <= l.Token || l2.Token > l.Token+10 {
		t.Errorf("second store's token %d, %v; want the next revision after %d", l2.Token, err, l.Token)
	}
}

// A bucket that existed before token bases keeps its revisions (base 0),
// whatever the floor says, so that upgraded workers continue its tokens.
func TestBucketWithoutBaseKeepsItsRevisions(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	kv, err := b.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "old", History: 1, TTL: testTTL, Storage: jetstream.FileStorage})
	if err != nil {
		t.Fatal(err)
	}
	rev, err := kv.Put(ctx, "x", []byte("y"))
	if err != nil {
		t.Fatal(err)
	}
	s := openTestStore(t, b.js, "old", fixed(1<<40), 1000)
	if base, err := s.TokenBase(ctx); err != nil || base != 0 {
		t.Errorf("token base of an old bucket = %d, %v; want 0", base, err)
	}
	l, err := s.Acquire(ctx, "g", "0", "A")
	if err != nil || l.Token != rev+1 {
		t.Fatalf("token %v, %v; want the next revision %d", l, err, rev+1)
	}
}

// A lost bucket is created again with tokens above both the largest token
// stored (the floor) and the largest revision the recreating store saw, so
// that Postgres accepts them without anyone resetting epochs.
func TestLostBucketIsCreatedAgainAboveEveryToken(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	const margin = 1000
	var floor atomic.Uint64
	s := openTestStore(t, b.js, "lost", floor.Load, margin)
	first, err := s.Acquire(ctx, "g", "0", "A") // a first bucket: no wait
	if err != nil {
		t.Fatal(err)
	}
	floor.Store(first.Token) // stored in Postgres by its claim
	// Renewals and heartbeats push the revisions far past the stored token.
	for range 50 {
		if err := s.Renew(ctx, first); err != nil {
			t.Fatal(err)
		}
	}
	seen := first.Revision()

	if err := b.js.DeleteKeyValue(ctx, "lost"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Acquire(ctx, "g", "1", "A"); err == nil {
		t.Fatal("acquire succeeded on a deleted bucket")
	}
	if err := s.Renew(ctx, first); err == nil {
		t.Fatal("renewal succeeded on a deleted bucket")
	}
	replaced, err := s.recreateIfMissing(ctx)
	if err != nil || !replaced {
		t.Fatalf("recreateIfMissing = %v, %v; want true, nil", replaced, err)
	}
	// Holders of the lost bucket may still be inside their validity:
	// acquires wait until it has run out.
	if _, err := s.Acquire(ctx, "g", "5", "B"); !errors.Is(err, ErrBucketNew) {
		t.Errorf("acquire right after creating the lost bucket again: %v; want ErrBucketNew", err)
	}
	if wait := time.Until(s.QuietUntil()); wait < testTTL-testMargin-200*time.Millisecond || wait > testTTL-testMargin {
		t.Errorf("acquires wait %v; want TTL-SafetyMargin (%v)", wait, testTTL-testMargin)
	}
	base, _ := s.TokenBase(ctx)
	if want := seen + margin; base != want {
		t.Errorf("new base %d; want the largest revision seen plus the margin, %d", base, want)
	}
	l := acquireWhenQuiet(t, s, "g", "0", "B")
	if l.Token <= seen+margin || l.Token <= floor.Load() {
		t.Errorf("token after the bucket was lost: %d; want above %d (seen %d + margin) and the floor %d", l.Token, seen+margin, seen, floor.Load())
	}
	// The old term is gone with its bucket: its renewal is lost, not an
	// overwrite of the new term.
	if err := s.Renew(ctx, first); !errors.Is(err, ErrLost) {
		t.Errorf("renewal of a term of the lost bucket: %v; want ErrLost", err)
	}

	// A store that never saw the old bucket (a fresh process) first waits
	// for the lost leases to run out (and for members that saw the bucket to
	// create it), then goes by the floor, read after the wait.
	if err := b.js.DeleteKeyValue(ctx, "lost"); err != nil {
		t.Fatal(err)
	}
	floor.Store(l.Token + 5000)
	go func() {
		time.Sleep(testTTL / 4)
		floor.Store(l.Token + 7000) // a holder of the lost bucket stores its token
	}()
	start := time.Now()
	fresh := openTestStore(t, b.js, "lost", floor.Load, margin)
	if waited := time.Since(start); waited < testTTL-testMargin {
		t.Errorf("a fresh store created the lost bucket after %v; want it to wait TTL-SafetyMargin (%v)", waited, testTTL-testMargin)
	}
	if base, _ := fresh.TokenBase(ctx); base != l.Token+7000+margin {
		t.Errorf("base from a fresh store: %d; want the floor read after the wait + margin = %d", base, l.Token+7000+margin)
	}
	if _, err := fresh.Acquire(ctx, "g", "0", "C"); err != nil {
		t.Errorf("acquire after the fresh store's wait: %v; want no second wait", err)
	}
}

// When several members find the bucket missing at once, each creating it with
// its own base, the first creation wins and every member uses that bucket.
func TestConcurrentRecreationAgreesOnOneBucket(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	const members = 6
	stores := make([]*Store, members)
	for i := range stores {
		stores[i] = openTestStore(t, connect(t, b.nats.URL), "race", fixed(uint64(1_000_000*(i+1))), 1000)
	}
	var before uint64
	for i, s := range stores {
		l := acquireWhenQuiet(t, s, "g", fmt.Sprint(i), "m")
		before = max(before, l.Token)
	}
	if err := b.js.DeleteKeyValue(ctx, "race"); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, members)
	start := make(chan struct{})
	for i, s := range stores {
		wg.Go(func() {
			<-start
			_, errs[i] = s.recreateIfMissing(ctx)
		})
	}
	close(start)
	wg.Wait()
	bases := map[uint64]bool{}
	for i, s := range stores {
		if errs[i] != nil {
			t.Errorf("store %d: recreate: %v", i, errs[i])
		}
		base, err := s.TokenBase(ctx)
		if err != nil {
			t.Fatal(err)
		}
		bases[base] = true
	}
	if len(bases) != 1 {
		t.Fatalf("stores see %d different bases %v; want one bucket", len(bases), bases)
	}
	var base uint64
	for b := range bases {
		base = b
	}
	t.Logf("%d stores recreated the bucket at once; base %d won", members, base)
	for i, s := range stores {
		l := acquireWhenQuiet(t, s, "g", fmt.Sprint(i), "n")
		if l.Token <= base || l.Token <= before {
			t.Errorf("store %d: token %d; want above the base %d and every earlier token (%d)", i, l.Token, base, before)
		}
	}
}

// A Manager whose bucket is deleted under it creates it again and claims
// its items with larger tokens, without any manual step, within 2 × TTL.
func TestManagerRecoversFromADeletedBucket(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tr := newTracker()
	defer tr.check(t)
	items := &itemList{}
	items.set(names("orders/", 6))
	for _, id := range []string{"A", "B"} {
		cfg := testManagerConfig(id)
		cfg.Bucket = "deleted"
		runMember(t, newManager(t, connect(t, b.nats.URL), cfg), items, tr)
	}
	want := Assign([]string{"A", "B"}, names("orders/", 6))
	settled := func(after map[string]uint64) func() bool {
		return func() bool {
			got, tokens := tr.owners(), tr.tokens()
			for it, owner := range want {
				if got[it] != owner || tokens[it] <= after[it] {
					return false
				}
			}
			return true
		}
	}
	waitFor(t, 10*time.Second, "A and B to own their items", settled(nil))
	before := tr.tokens()
	var maxBefore uint64
	for _, tok := range before {
		maxBefore = max(maxBefore, tok)
	}
	if err := b.js.DeleteKeyValue(testContext(t), "deleted"); err != nil {
		t.Fatal(err)
	}
	took := waitFor(t, 2*testTTL, "every item to be claimed again with a larger token", settled(before))
	t.Logf("items claimed again %v after the bucket was deleted (TTL %v, renew %v)", took, testTTL, testRenew)
	// Nobody acquires in the new bucket before the lost leases have run
	// out (the tracker fails the test if two members overlap).
	if took < testTTL-testMargin {
		t.Errorf("items claimed again %v after the deletion, before the lost leases (valid for TTL-SafetyMargin = %v) ran out", took, testTTL-testMargin)
	}
	for it, tok := range tr.tokens() {
		if tok <= maxBefore+DefaultTokenMargin {
			t.Errorf("item %s: token %d after the loss; want above %d (every earlier token + margin)", it, tok, maxBefore+DefaultTokenMargin)
		}
	}
}

// An unhealthy member steps out: its leases are released (not left to
// expire), its heartbeat is deleted, it acquires nothing, and the other
// member takes its items at once. Healthy again, it rejoins.
func TestManagerUnhealthyMemberStepsOut(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tr := newTracker()
	defer tr.check(t)
	items := &itemList{}
	items.set(names("orders/", 6))
	var sick atomic.Pointer[error]
	cfgA := testManagerConfig("A")
	cfgA.Healthy = func() error {
		if p := sick.Load(); p != nil {
			return *p
		}
		return nil
	}
	runMember(t, newManager(t, connect(t, b.nats.URL), cfgA), items, tr)
	runMember(t, newManager(t, connect(t, b.nats.URL), testManagerConfig("B")), items, tr)
	want := Assign([]string{"A", "B"}, names("orders/", 6))
	ownedBy := func(owners map[string]string) func() bool {
		return func() bool {
			got := tr.owners()
			if len(got) != len(owners) {
				return false
			}
			for it, o := range owners {
				if got[it] != o {
					return false
				}
			}
			return true
		}
	}
	waitFor(t, 10*time.Second, "A and B to own their items", ownedBy(want))

	errDB := errors.New("database unreachable")
	sick.Store(&errDB)
	allB := map[string]string{}
	for it := range want {
		allB[it] = "B"
	}
	took := waitFor(t, testTTL, "B to own every item", ownedBy(allB))
	t.Logf("B owned every item %v after A turned unhealthy (TTL %v, renew %v)", took, testTTL, testRenew)
	if took > 2*testRenew+testTTL/2 {
		t.Errorf("takeover took %v; an unhealthy member must release at once, not let its leases expire (TTL %v)", took, testTTL)
	}
	tr.mu.Lock()
	for it, owner := range want {
		if owner == "A" && !errors.Is(tr.causes[it], errDB) {
			t.Errorf("A's work on %s stopped with cause %v; want the health error", it, tr.causes[it])
		}
	}
	tr.mu.Unlock()
	members, err := b.store.Members(testContext(t), "fn.orders")
	if err != nil || len(members) != 1 || members[0] != "B" {
		t.Errorf("members while A is unhealthy: %v, %v; want [B]", members, err)
	}
	time.Sleep(3 * testRenew) // A must not acquire anything meanwhile
	if !ownedBy(allB)() {
		t.Errorf("an unhealthy member acquired items: %v", tr.owners())
	}

	sick.Store(nil)
	took = waitFor(t, 10*time.Second, "A to rejoin and take its share back", ownedBy(want))
	t.Logf("A rejoined and owned its share %v after turning healthy", took)
}

// A listing of the members can miss a heartbeat that is rewritten while it
// runs. The membership loop must not take such a member for gone: that
// would move its items away and back, each time under a new token.
func TestMembershipIgnoresHeartbeatsRewrittenDuringAListing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	m := newManager(t, connect(t, b.nats.URL), testManagerConfig("self"))
	r := &run{m: m, cfg: m.cfg}
	others := []string{"a", "b", "c"}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	for _, id := range others {
		if err := b.store.Heartbeat(ctx, "fn.orders", id); err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			for wctx.Err() == nil {
				_ = b.store.Heartbeat(wctx, "fn.orders", id)
				time.Sleep(2 * time.Millisecond)
			}
		})
	}
	defer wg.Wait()
	defer cancel()
	known := []string{"a", "b", "c", "self"}
	rawPartial, timedOut := 0, 0
	for i := range 300 {
		list, err := r.beat(ctx, known)
		if errors.Is(err, context.DeadlineExceeded) {
			// A beat bounded by RenewEvery that ran out (a loaded machine,
			// -race): the manager's loop beats again; what is checked here
			// is that a listing that returns misses no member.
			timedOut++
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(list, known) {
			t.Fatalf("listing %d: members %v; want %v", i, list, known)
		}
		if raw, err := b.store.Members(ctx, "fn.orders"); err == nil && len(raw) != len(known) {
			rawPartial++
		}
	}
	if timedOut > 30 {
		t.Fatalf("%d of 300 beats ran out of time: too few listings checked", timedOut)
	}
	t.Logf("plain listings that missed a member: %d of %d (the membership loop missed none; %d beats ran out of time)", rawPartial, 300-timedOut, timedOut)
}
