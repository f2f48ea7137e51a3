package lease

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

func TestAcquireRenewRelease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	s := b.store

	a, err := s.Acquire(ctx, "fn.orders", "orders/0", "A")
	if err != nil {
		t.Fatalf("acquire: %v", err)
	}
	if a.Token == 0 || a.Revision() != a.Token {
		t.Fatalf("acquire: token %d revision %d; want equal and non-zero", a.Token, a.Revision())
	}
	if _, err := s.Acquire(ctx, "fn.orders", "orders/0", "B"); !errors.Is(err, ErrHeld) {
		t.Fatalf("second acquire: err = %v; want ErrHeld", err)
	}
	// Another item of the same group is independent.
	other, err := s.Acquire(ctx, "fn.orders", "orders/1", "B")
	if err != nil {
		t.Fatalf("acquire other item: %v", err)
	}

	before := a.ValidUntil()
	time.Sleep(20 * time.Millisecond)
	if err := s.Renew(ctx, a); err != nil {
		t.Fatalf("renew: %v", err)
	}
	if a.Revision() <= a.Token || !a.ValidUntil().After(before) {
		t.Fatalf("renew: revision %d (token %d), valid until moved %v; want a newer revision and a later validity",
			a.Revision(), a.Token, a.ValidUntil().Sub(before))
	}
	h, err := s.Holder(ctx, "fn.orders", "orders/0")
	if err != nil {
		t.Fatalf("holder: %v", err)
	}
	if h.Owner != "A" || h.Token != a.Token || h.Revision != a.Revision() || h.Age() < 0 || h.Age() > time.Minute {
		t.Fatalf("holder = %+v; want owner A token %d revision %d", h, a.Token, a.Revision())
	}
	if _, err := s.Acquire(ctx, "fn.orders", "orders/0", "B"); !errors.Is(err, ErrHeld) {
		t.Fatalf("acquire after renew: err = %v; want ErrHeld", err)
	}

	if err := s.Release(ctx, a); err != nil {
		t.Fatalf("release: %v", err)
	}
	if a.Valid() {
		t.Fatal("lease still valid after release")
	}
	if err := s.Renew(ctx, a); !errors.Is(err, ErrLost) {
		t.Fatalf("renew after release: err = %v; want ErrLost", err)
	}
	if _, err := s.Holder(ctx, "fn.orders", "orders/0"); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("holder after release: err = %v; want ErrNotHeld", err)
	}
	// Release frees the key at once, and the next term's token is larger.
	bl, err := s.Acquire(ctx, "fn.orders", "orders/0", "B")
	if err != nil {
		t.Fatalf("acquire after release: %v", err)
	}
	if bl.Token <= a.Revision() || bl.Token <= other.Token {
		t.Fatalf("next token %d; want greater than every earlier revision (%d, %d)", bl.Token, a.Revision(), other.Token)
	}
	// A third term after another release grows again.
	if err := s.Release(ctx, bl); err != nil {
		t.Fatalf("release B: %v", err)
	}
	c, err := s.Acquire(ctx, "fn.orders", "orders/0", "C")
	if err != nil {
		t.Fatalf("acquire C: %v", err)
	}
	if c.Token <= bl.Token {
		t.Fatalf("token %d after token %d; want strictly growing", c.Token, bl.Token)
	}
}

func TestUnrenewedLeaseExpiresAfterTTLNotBefore(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	s := b.store

	sent := time.Now()
	a, err := s.Acquire(ctx, "g", "p", "A")
	if err != nil {
		t.Fatalf("acquire: %v", err)
	}
	var bl *Lease
	for bl == nil {
		l, err := s.Acquire(ctx, "g", "p", "B")
		switch {
		case err == nil:
			bl = l
		case errors.Is(err, ErrHeld):
			time.Sleep(5 * time.Millisecond)
		default:
			t.Fatalf("acquire B: %v", err)
		}
		if time.Since(sent) > testTTL+livenessBound {
			t.Fatalf("lease not expired %v after its last write (TTL %v, liveness bound TTL+%v)", time.Since(sent), testTTL, livenessBound)
		}
	}
	took := time.Since(sent)
	t.Logf("unrenewed lease taken by another member %v after the holder's last write (TTL %v)", took, testTTL)
	if took < testTTL {
		t.Fatalf("lease taken after %v, before TTL %v", took, testTTL)
	}
	// The holder gave up before anyone could take it, by at least the margin.
	if gap := time.Until(a.ValidUntil()); gap > -testMargin {
		t.Fatalf("holder validity ended only %v before the takeover; want at least %v", -gap, testMargin)
	}
	if bl.Token <= a.Token {
		t.Fatalf("token after expiry %d; want greater than %d", bl.Token, a.Token)
	}
	if err := s.Renew(ctx, a); !errors.Is(err, ErrLost) {
		t.Fatalf("renew of expired lease: err = %v; want ErrLost", err)
	}
}

func TestSeizeFencesTheHolder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	s := b.store

	a, err := s.Acquire(ctx, "g", "p", "A")
	if err != nil {
		t.Fatalf("acquire: %v", err)
	}
	if err := s.Renew(ctx, a); err != nil {
		t.Fatalf("renew: %v", err)
	}
	r, err := s.Seize(ctx, "g", "p", "replay-cli")
	if err != nil {
		t.Fatalf("seize: %v", err)
	}
	if r.Token <= a.Revision() {
		t.Fatalf("seized token %d; want greater than the holder's revision %d", r.Token, a.Revision())
	}
	if err := s.Renew(ctx, a); !errors.Is(err, ErrLost) {
		t.Fatalf("old holder's renew after seize: err = %v; want ErrLost", err)
	}
	h, err := s.Holder(ctx, "g", "p")
	if err != nil || h.Owner != "replay-cli" || h.Token != r.Token || !h.Seized {
		t.Fatalf("holder after seize = %+v, %v; want replay-cli with token %d", h, err, r.Token)
	}
	if _, err := s.Acquire(ctx, "g", "p", "B"); !errors.Is(err, ErrHeld) {
		t.Fatalf("acquire while seized: err = %v; want ErrHeld", err)
	}
	if err := s.Renew(ctx, r); err != nil {
		t.Fatalf("renew seized lease: %v", err)
	}
	if h, err := s.Holder(ctx, "g", "p"); err != nil || h.Token != r.Token || h.Revision != r.Revision() {
		t.Fatalf("holder after renewing the seized lease = %+v, %v; want token %d", h, err, r.Token)
	}
	if err := s.Release(ctx, r); err != nil {
		t.Fatalf("release seized lease: %v", err)
	}
	bl, err := s.Acquire(ctx, "g", "p", "B")
	if err != nil || bl.Token <= r.Revision() {
		t.Fatalf("acquire after the seizer released: %v, token %v; want > %d", err, bl, r.Revision())
	}
}

// A renewal that the server applied but whose reply was lost leaves the
// holder with a stale revision; the next renewal must recognise its own term
// instead of giving the lease up.
func TestRenewRecoversFromALostReply(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	s := b.store

	a, err := s.Acquire(ctx, "g", "p", "A")
	if err != nil {
		t.Fatalf("acquire: %v", err)
	}
	v := a.value
	v.Token = a.Token
	data, _ := json.Marshal(v)
	applied, err := s.kv.Update(ctx, a.key, data, a.revision)
	if err != nil {
		t.Fatalf("write the renewal behind the lease's back: %v", err)
	}
	if err := s.Renew(ctx, a); err != nil {
		t.Fatalf("renew after a lost reply: %v", err)
	}
	if a.Revision() <= applied {
		t.Fatalf("revision %d after recovery; want newer than %d", a.Revision(), applied)
	}
	// A different term with the same owner name is not mistaken for ours.
	if _, err := s.Seize(ctx, "g", "p", "A"); err != nil {
		t.Fatalf("seize: %v", err)
	}
	if err := s.Renew(ctx, a); !errors.Is(err, ErrLost) {
		t.Fatalf("renew after a same-named seize: err = %v; want ErrLost", err)
	}
}

func TestMembersListsLiveHeartbeats(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	s := b.store

	for _, hb := range [][2]string{{"g", "B"}, {"g", "A"}, {"g", "A"}, {"g.other", "C"}, {"g", "host.1"}} {
		if err := s.Heartbeat(ctx, hb[0], hb[1]); err != nil {
			t.Fatalf("heartbeat %v: %v", hb, err)
		}
	}
	// A lease in group g is not a member.
	if _, err := s.Acquire(ctx, "g", "p", "A"); err != nil {
		t.Fatalf("acquire: %v", err)
	}
	got, err := s.Members(ctx, "g")
	if err != nil || strings.Join(got, ",") != "A,B,host.1" {
		t.Fatalf("members = %v, %v; want [A B host.1]", got, err)
	}
	if err := s.Leave(ctx, "g", "B"); err != nil {
		t.Fatalf("leave: %v", err)
	}
	got, err = s.Members(ctx, "g")
	if err != nil || strings.Join(got, ",") != "A,host.1" {
		t.Fatalf("members after leave = %v, %v; want [A host.1]", got, err)
	}
	// Heartbeats that stop expire with the bucket's MaxAge.
	took := waitFor(t, testTTL+livenessBound, "heartbeats to expire", func() bool {
		got, err = s.Members(ctx, "g")
		return err == nil && len(got) == 0
	})
	t.Logf("heartbeats expired %v after the leave (TTL %v)", took, testTTL)
	if got, err := s.Members(ctx, "nobody"); err != nil || len(got) != 0 {
		t.Fatalf("members of an empty group = %v, %v", got, err)
	}
}

func TestOpenStoreRefusesABucketWithAnotherTTL(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	// Same configuration: opens.
	if _, err := OpenStore(ctx, b.js, b.store.Config()); err != nil {
		t.Fatalf("reopen with the same config: %v", err)
	}
	cfg := b.store.Config()
	cfg.TTL = 3 * time.Second
	_, err := OpenStore(ctx, b.js, cfg)
	if err == nil || !strings.Contains(err.Error(), "TTL") {
		t.Fatalf("open with another TTL: err = %v; want an error about TTL", err)
	}
}

// A bucket with other replicas than configured is refused, not changed; a
// Store that may not create its bucket says it is missing.
func TestOpenStoreRefusesOtherReplicasAndNoCreateCreatesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	cfg := b.store.Config()
	cfg.Replicas = 3
	_, err := OpenStore(ctx, b.js, cfg)
	var re *ReplicasError
	if !errors.As(err, &re) || re.Have != 1 || re.Want != 3 || !strings.Contains(err.Error(), "kfn does not change an existing stream") {
		t.Fatalf("open with 3 replicas a bucket of 1: err = %v; want a *ReplicasError 1 vs 3", err)
	}
	if st, err := b.store.kv.Status(ctx); err != nil || st.(*jetstream.KeyValueBucketStatus).StreamInfo().Config.Replicas != 1 {
		t.Fatalf("the bucket's replicas changed: %v", err)
	}
	cfg = b.store.Config()
	cfg.Bucket += "-missing"
	cfg.NoCreate = true
	if _, err := OpenStore(ctx, b.js, cfg); !errors.Is(err, jetstream.ErrBucketNotFound) {
		t.Fatalf("open a missing bucket with NoCreate: err = %v; want bucket not found", err)
	}
	if _, err := b.js.KeyValue(ctx, cfg.Bucket); !errors.Is(err, jetstream.ErrBucketNotFound) {
		t.Fatalf("NoCreate created the bucket: %v", err)
	}
}

func TestReclaimOwnDeletesOnlyThisInstancesTerm(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := testContext(t)
	s := b.store

	a, err := s.acquire(ctx, "g", "p", "A", "run-1", 0)
	if err != nil {
		t.Fatalf("acquire: %v", err)
	}
	for _, other := range []string{"run-2", ""} {
		if ok, err := s.reclaimOwn(ctx, "g", "p", other); ok || err != nil {
			t.Fatalf("reclaim by instance %q = %v, %v; want nothing deleted", other, ok, err)
		}
	}
	if h, err := s.Holder(ctx, "g", "p"); err != nil || h.Token != a.Token {
		t.Fatalf("holder after foreign reclaims = %+v, %v; want token %d", h, err, a.Token)
	}
	if err := s.Renew(ctx, a); err != nil {
		t.Fatalf("renew: %v", err)
	}
	if ok, err := s.reclaimOwn(ctx, "g", "p", "run-1"); !ok || err != nil {
		t.Fatalf("reclaim by the writing instance = %v, %v; want deleted", ok, err)
	}
	if _, err := s.Holder(ctx, "g", "p"); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("holder after reclaim: err = %v; want ErrNotHeld", err)
	}
	if ok, err := s.reclaimOwn(ctx, "g", "p", "run-1"); ok || err != nil {
		t.Fatalf("reclaim of a free key = %v, %v; want nothing", ok, err)
	}
	// A term seized from the instance is not its own any more.
	if _, err := s.acquire(ctx, "g", "q", "A", "run-1", 0); err != nil {
		t.Fatalf("acquire q: %v", err)
	}
	if _, err := s.Seize(ctx, "g", "q", "replay-cli"); err != nil {
		t.Fatalf("seize q: %v", err)
	}
	if ok, err := s.reclaimOwn(ctx, "g", "q", "run-1"); ok || err != nil {
		t.Fatalf("reclaim of a seized term = %v, %v; want nothing deleted", ok, err)
	}
}
