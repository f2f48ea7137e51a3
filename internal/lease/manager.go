package lease

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/kfn-dev/kfn/internal/repeatlog"
	"github.com/nats-io/nats.go/jetstream"
)

// Claim is a lease this member holds on an item, handed to the work
// function. Token is the fencing token of the term: the work must make
// Postgres check it on every commit.
type Claim struct {
	Item  string
	Token uint64
}

// Manager keeps this member in its group, works out which items it should
// own, and holds their leases while running work on them.
type Manager struct {
	cfg     Config
	store   *Store
	log     *slog.Logger
	repeats *repeatlog.Log // its retried failures, logged once per step (package repeatlog)
	running atomic.Bool

	// onRenewed, if set (by tests), is called after each successful renewal
	// with the send time of that renewal.
	onRenewed func(item string, sent time.Time)
	// onListed, if set (by tests), is called with each listing of the
	// members before the loop gets it.
	onListed func(members []string)
}

// openTimeout bounds NewManager's bucket creation, besides the TTL it may
// wait when a lost bucket has to be created again.
const openTimeout = 10 * time.Second

// NewManager validates cfg (after WithDefaults) and creates or opens the
// bucket, within ctx and openTimeout (plus TTL).
func NewManager(ctx context.Context, js jetstream.JetStream, cfg Config) (*Manager, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, openTimeout+cfg.TTL)
	defer cancel()
	store, err := OpenStore(ctx, js, cfg.storeConfig())
	if err != nil {
		return nil, fmt.Errorf("new lease manager for %s: %w", cfg.Group, err)
	}
	return &Manager{
		cfg:     cfg,
		store:   store,
		log:     cfg.Logger.With("group", cfg.Group, "member", cfg.MemberID),
		repeats: repeatlog.New(),
	}, nil
}

// Config returns the manager's configuration, defaults applied.
func (m *Manager) Config() Config { return m.cfg }

// Store returns the manager's store, for status reads.
func (m *Manager) Store() *Store { return m.store }

// Run keeps this member's heartbeat, computes the target owner of each item
// over the live members (Assign), acquires the leases of the items this
// member is the target of, and runs work(ctx, claim) for each in its own
// goroutine.
//
// The claim's ctx is cancelled when the claim must stop: its lease is lost
// (no renewal succeeded for TTL-SafetyMargin), the item moved to another
// member, the item is no longer listed by items, or Run's ctx ended. Work
// should finish its in-flight batch and return promptly; the lease is
// renewed until it does (so a work function that never returns keeps the
// item from its next owner) and then, if still valid, released so that the
// next owner can take it at once. If work returns on its own, the lease is
// released and taken again after RenewEvery if this member is still the
// target.
//
// items is called every PollItemsEvery and on membership changes; its
// errors are logged and the last good list is kept. NATS errors never end
// Run: it retries with backoff. Run returns nil once ctx has ended and all
// work has returned, or an error if called with nil functions or while
// already running.
func (m *Manager) Run(ctx context.Context, items func(context.Context) ([]string, error), work func(ctx context.Context, c Claim)) error {
	if items == nil || work == nil {
		return errors.New("lease manager run: items and work must not be nil")
	}
	if !m.running.CompareAndSwap(false, true) {
		return fmt.Errorf("lease manager run: member %s of %s is already running", m.cfg.MemberID, m.cfg.Group)
	}
	defer m.running.Store(false)

	r := &run{
		m:         m,
		instance:  newInstanceID(),
		cfg:       m.cfg,
		log:       m.log,
		items:     items,
		work:      work,
		members:   map[string]bool{m.cfg.MemberID: true},
		watched:   map[string]time.Time{},
		freedAt:   map[string]uint64{},
		claims:    map[string]*claim{},
		uncertain: map[string]bool{},
		cooldown:  map[string]time.Time{},
		memberSet: make(chan memberListing, 1),
		rewatch:   make(chan struct{}, 1),
		beatNow:   make(chan struct{}, 1),
		itemList:  make(chan []string, 1),
		pollNow:   make(chan struct{}, 1),
		events:    make(chan event, 64),
		finished:  make(chan claimEnd),
		stopped:   make(chan struct{}),
		acquireBO: backoff.NewExponentialBackOff(
			backoff.WithInitialInterval(m.cfg.RenewEvery/4),
			backoff.WithMaxInterval(2*m.cfg.RenewEvery),
			backoff.WithMaxElapsedTime(0),
		),
	}
	return r.loop(ctx)
}

// run is the state of one Run call. Fields below the channels are owned by
// the loop goroutine.
type run struct {
	m        *Manager
	instance string // written into this run's lease values
	cfg      Config
	log      *slog.Logger
	items    func(context.Context) ([]string, error)
	work     func(context.Context, Claim)

	memberSet chan memberListing // membership goroutine → loop, latest listing
	rewatch   chan struct{}      // membership goroutine → watch: the bucket was created again
	beatNow   chan struct{}      // loop → membership goroutine: health changed, leave or rejoin now
	itemList  chan []string      // items poller → loop, latest list
	pollNow   chan struct{}      // loop → items poller
	events    chan event         // watch goroutine → loop
	finished  chan claimEnd      // claim goroutines → loop
	stopped   chan struct{}      // closed when the loop stops receiving
	helpers   sync.WaitGroup     // membership, watch, items poller
	claimWG   sync.WaitGroup

	members      map[string]bool
	membersKnown bool
	// watched is when the loop applied the last watched change of each
	// member (joined or left) that a listing may not reflect yet.
	watched map[string]time.Time
	// freedAt is the revision of the delete or expiry marker the watch
	// last showed for an item's lease, until take uses it.
	freedAt     map[string]uint64
	itemSet     []string
	itemsKnown  bool
	claims      map[string]*claim
	cooldown    map[string]time.Time
	uncertain   map[string]bool // items whose acquire got no answer
	acquireBO   *backoff.ExponentialBackOff
	nextAcquire time.Time
	wake        *time.Timer // fires at nextAcquire
	unhealthy   error       // the member's health as last checked; nil when healthy
	loggedHeld  []string    // the held items last logged (logHeld)
	heldLine    *time.Timer // fires when the held set's change is to be logged
	heldLineDue bool        // heldLine is armed
}

type claimEnd struct {
	item  string
	early bool // work returned before being asked to stop
	// When the claim's ctx ended (zero if early), its work returned, and
	// its lease was deleted (zero if it was not released).
	stopAsked, workReturned, released time.Time
}

func (r *run) loop(ctx context.Context) error {
	r.log.Info("lease manager starting", "ttl", r.cfg.TTL, "renew_every", r.cfg.RenewEvery, "safety_margin", r.cfg.SafetyMargin)
	// When ctx ended, which may be before the loop notices it (it may be
	// inside an acquire's round trips): the shutdown's phases count from it.
	ended := make(chan time.Time, 1)
	defer context.AfterFunc(ctx, func() { ended <- time.Now() })()
	r.helpers.Add(3)
	go r.keepMembership(ctx)
	go r.watch(ctx)
	go r.pollItems(ctx)

	tick := time.NewTicker(r.cfg.RenewEvery)
	defer tick.Stop()
	r.wake = time.NewTimer(time.Hour)
	r.wake.Stop()
	defer r.wake.Stop()
	r.heldLine = time.NewTimer(time.Hour)
	r.heldLine.Stop()
	defer r.heldLine.Stop()
	var healthC <-chan time.Time // the health hook is asked more often than the tick
	if r.cfg.Healthy != nil {
		ht := time.NewTicker(r.cfg.RenewEvery / 4)
		defer ht.Stop()
		healthC = ht.C
	}
	for {
		changed := true
		select {
		case <-ctx.Done():
			r.shutdown(<-ended)
			return nil
		case listing := <-r.memberSet:
			changed = r.setMembers(listing) || !r.membersKnown
			r.membersKnown = true
		case ev := <-r.events:
			changed = r.applyEvents(ctx, ev)
		case list := <-r.itemList:
			changed = !r.itemsKnown || !slices.Equal(list, r.itemSet)
			r.itemSet, r.itemsKnown = list, true
		case end := <-r.finished:
			delete(r.claims, end.item)
			if end.early {
				r.cooldown[end.item] = time.Now().Add(r.cfg.RenewEvery)
			}
		case <-tick.C:
		case <-r.wake.C:
		case <-healthC:
			changed = false
		case <-r.heldLine.C:
			r.heldLineDue = false
			r.logHeld()
			changed = false
		}
		if r.checkHealth() {
			changed = true
		}
		if changed {
			r.reconcile(ctx)
		}
		if !r.heldLineDue && !slices.Equal(r.held(), r.loggedHeld) {
			// A rebalance acquires or releases items one after another:
			// one line once it has settled (RenewEvery later), not one
			// per item.
			r.heldLineDue = true
			r.heldLine.Reset(r.cfg.RenewEvery)
		}
	}
}

// held lists the items this member holds leases on, sorted.
func (r *run) held() []string {
	held := slices.AppendSeq([]string{}, maps.Keys(r.claims)) // [] rather than null in JSON
	slices.Sort(held)
	return held
}

// logHeld logs the items this member holds leases on, at Info, when they
// differ from the last line. Each acquire, renewal and release is logged
// per item at Debug only: with many items, one line per change of the
// set says what an operator needs.
func (r *run) logHeld() {
	held := r.held()
	if slices.Equal(held, r.loggedHeld) {
		return
	}
	r.loggedHeld = held
	r.log.Info("leases held", "held", len(held), "items", held)
}

// shutdown leaves the group, waits for every claim to stop and release its
// lease, and logs how long each phase took after Run's ctx ended (at
// stopAsked): the others can take an item once this member has left and
// its lease is released.
func (r *run) shutdown(stopAsked time.Time) {
	// Leave at once: the others stop counting this member and take each of
	// its items as soon as its lease is released, instead of once the
	// helpers below have wound down (a tenth of a second on a busy machine).
	r.leave()
	left := time.Since(stopAsked)
	r.helpers.Wait() // no heartbeat after this point
	// A heartbeat in flight when Run's ctx ended may have landed after the
	// first leave; left there, it would keep this member's items assigned
	// to it until the key's TTL.
	r.leave()
	// Every claim's ctx derives from Run's, so all are stopping; each
	// releases its lease once its work returns, then reports here (the
	// loop took the ends of the others).
	phases := shutdownPhases{stopAsked: stopAsked}
	for range len(r.claims) {
		phases.note(<-r.finished)
	}
	close(r.stopped)
	r.claimWG.Wait()
	clear(r.claims)
	r.logHeld()
	for item := range r.uncertain {
		if err := r.reclaim(context.Background(), item); err != nil {
			r.log.Warn("delete an abandoned lease", "item", item, "err", err)
		}
	}
	r.log.Info("lease manager stopped", append([]any{"left_after", left}, phases.attrs()...)...)
}

// shutdownPhases gathers how the claims held at shutdown ended, timed from
// when Run's ctx ended.
type shutdownPhases struct {
	stopAsked          time.Time
	claims, released   int
	lastWork, lastFree time.Time // the latest work return and lease release
	slowest            string    // the item whose work returned last
}

func (p *shutdownPhases) note(end claimEnd) {
	p.claims++
	// Run noted the end of its ctx in a goroutine that may have run after
	// a claim's work had already returned: the stop came no later than
	// any claim noticed it.
	if !end.stopAsked.IsZero() {
		p.stopAsked = minTime(p.stopAsked, end.stopAsked)
	}
	if end.workReturned.After(p.lastWork) {
		p.lastWork, p.slowest = end.workReturned, end.item
	}
	if !end.released.IsZero() {
		p.released++
		p.lastFree = later(p.lastFree, end.released)
	}
}

// attrs are the log attributes of the phases: the work of every claim
// returned by work_returned_after (slowest_item's last), and every lease
// released was deleted by released_after.
func (p *shutdownPhases) attrs() []any {
	attrs := []any{"claims", p.claims, "released", p.released}
	if p.claims > 0 {
		attrs = append(attrs, "work_returned_after", p.lastWork.Sub(p.stopAsked), "slowest_item", p.slowest)
	}
	if p.released > 0 {
		attrs = append(attrs, "released_after", p.lastFree.Sub(p.stopAsked))
	}
	return attrs
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// leave deletes this member's heartbeat.
func (r *run) leave() {
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.RenewEvery)
	defer cancel()
	if err := r.m.store.Leave(ctx, r.cfg.Group, r.cfg.MemberID); err != nil {
		r.log.Warn("leave group", "err", err)
	}
}

// health asks the Healthy hook; nil means healthy.
func (r *run) health() error {
	if r.cfg.Healthy == nil {
		return nil
	}
	return r.cfg.Healthy()
}

// checkHealth records the member's health and reports whether it changed.
// An unhealthy member stops every claim (reconcile also acquires nothing);
// each lease is released once its work returns.
func (r *run) checkHealth() bool {
	err := r.health()
	changed := (err == nil) != (r.unhealthy == nil)
	switch {
	case err != nil && r.unhealthy == nil:
		r.log.Warn("member unhealthy: stepping out, releasing every lease and acquiring none until healthy again", "claims", len(r.claims), "err", err)
	case err == nil && r.unhealthy != nil:
		r.log.Info("member healthy again: rejoining")
	}
	r.unhealthy = err
	if changed {
		select {
		case r.beatNow <- struct{}{}:
		default:
		}
	}
	return changed
}

// memberListing is a listing of the live members, and when it began.
type memberListing struct {
	members []string
	began   time.Time
}

// setMembers replaces the member set with a fresh listing and reports
// whether it changed. A member whose joining or leaving the watch showed
// after the listing began keeps the state the watch gave it: the listing
// may predate that change. (A listing begun before a member left, and
// handed over after its departure, would bring it back, move its items
// to it and back again, and hold them up until the next listing.)
func (r *run) setMembers(listing memberListing) bool {
	next := map[string]bool{r.cfg.MemberID: true}
	for _, id := range listing.members {
		next[id] = true
	}
	for id, at := range r.watched {
		switch {
		case !at.After(listing.began):
			delete(r.watched, id) // this listing, and every later one, saw the change
		case r.members[id]:
			next[id] = true
		default:
			delete(next, id)
		}
	}
	if maps.Equal(next, r.members) {
		return false
	}
	r.log.Info("members changed", "members", slices.Sorted(maps.Keys(next)))
	r.members = next
	r.triggerItemsPoll()
	return true
}

// handleEvent applies a watched change and reports whether it may change
// what this member should do.
func (r *run) handleEvent(ev event) bool {
	switch ev.kind {
	case memberUp:
		if r.members[ev.name] {
			return false // a heartbeat of a known member
		}
		r.members[ev.name] = true
		r.watched[ev.name] = time.Now()
		r.log.Info("member joined", "joined", ev.name)
		r.triggerItemsPoll()
		return true
	case memberDown:
		// This member stays in its own set: a missing heartbeat of its own
		// is rewritten at the next beat.
		if ev.name == r.cfg.MemberID {
			return false
		}
		r.watched[ev.name] = time.Now()
		if !r.members[ev.name] {
			return false
		}
		delete(r.members, ev.name)
		r.log.Info("member left", "left", ev.name)
		r.triggerItemsPoll()
		return true
	}
	return false
}

// applyEvents applies ev and the watched changes queued behind it, and
// reports whether they may change what this member should do. Leases
// freed one after another (a member that stops releases all of its) are
// taken together; after a change of the members, reconcile takes them
// with the rest in one go.
func (r *run) applyEvents(ctx context.Context, ev event) (changed bool) {
	var freed []string
	for {
		if ev.kind == leaseFree {
			freed = append(freed, ev.name)
			r.freedAt[ev.name] = ev.revision
		} else {
			changed = r.handleEvent(ev) || changed
		}
		select {
		case ev = <-r.events:
			continue
		default:
		}
		if !changed {
			r.takeFreed(ctx, freed...)
		}
		return changed
	}
}

// takeFreed acquires items whose leases were just deleted or ran out, those
// this member is the target of. It tries those items alone: a full
// reconcile would also try every item still held elsewhere, at three round
// trips each, on every release of a handoff. The tick's reconcile retries
// the rest.
func (r *run) takeFreed(ctx context.Context, items ...string) {
	now := time.Now()
	if len(items) == 0 || ctx.Err() != nil || r.unhealthy != nil || !r.itemsKnown || !r.membersKnown || now.Before(r.nextAcquire) {
		return
	}
	owners := Assign(slices.Collect(maps.Keys(r.members)), r.itemSet)
	var take []string
	for _, item := range items {
		if r.claims[item] == nil && !now.Before(r.cooldown[item]) && owners[item] == r.cfg.MemberID && !slices.Contains(take, item) {
			take = append(take, item)
		}
	}
	r.take(ctx, take...)
}

func (r *run) triggerItemsPoll() {
	select {
	case r.pollNow <- struct{}{}:
	default:
	}
}

// reconcile stops claims that should stop and acquires leases of items this
// member is the target of.
func (r *run) reconcile(ctx context.Context) {
	if ctx.Err() != nil {
		return
	}
	if r.unhealthy != nil {
		for _, c := range r.claims {
			c.stop(r.log, fmt.Errorf("member unhealthy: %w", r.unhealthy))
		}
		return
	}
	if !r.itemsKnown {
		return // no claims yet either
	}
	owners := Assign(slices.Collect(maps.Keys(r.members)), r.itemSet)
	for item, c := range r.claims {
		if target, listed := owners[item]; !listed {
			c.stop(r.log, errors.New("item no longer listed"))
		} else if target != r.cfg.MemberID {
			c.stop(r.log, errors.New("rebalanced to "+target))
		}
	}
	if !r.membersKnown || time.Now().Before(r.nextAcquire) {
		return
	}
	// Acquires that got no answer may have been applied after all. Where
	// such a term is in another member's way, delete it.
	for item := range r.uncertain {
		if r.claims[item] != nil || owners[item] == r.cfg.MemberID {
			continue // the acquire below settles it
		}
		if err := r.reclaim(ctx, item); err != nil {
			r.backOff("delete an abandoned lease failed; backing off", item, err)
			return
		}
	}
	now := time.Now()
	var take []string
	for _, item := range r.itemSet {
		if r.claims[item] != nil || owners[item] != r.cfg.MemberID || now.Before(r.cooldown[item]) {
			continue
		}
		take = append(take, item)
	}
	r.take(ctx, take...)
}

// take acquires items, all at once, and starts the claim of each lease
// acquired. An acquire is three round trips to NATS, which take up to 0.2 s
// each on a busy machine: one after the other, the last of the six items
// of a member that left was measured taken 0.65 s after its departure. It
// reports false when acquiring must pause (a lost bucket, or a failure to
// back off from).
func (r *run) take(ctx context.Context, items ...string) bool {
	type result struct {
		l    *Lease
		err  error
		took time.Duration
	}
	results := make([]result, len(items))
	var wg sync.WaitGroup
	for i, item := range items {
		delete(r.cooldown, item)
		freedAt := r.freedAt[item]
		delete(r.freedAt, item)
		wg.Go(func() {
			began := time.Now()
			l, err := r.acquire(ctx, item, freedAt)
			results[i] = result{l, err, time.Since(began)}
		})
	}
	wg.Wait()
	ok := true
	for i, item := range items {
		l, err, took := results[i].l, results[i].err, results[i].took
		if err == nil || errors.Is(err, ErrHeld) {
			delete(r.uncertain, item)
		} else {
			r.uncertain[item] = true // the Create may have landed (and, for a lost bucket, its undo failed)
		}
		switch {
		case err == nil:
			r.acquireBO.Reset()
			r.m.repeats.Over(ctx, r.log, acquireFailed)
			r.startClaim(ctx, l, took)
		case errors.Is(err, ErrHeld):
			r.acquireBO.Reset()
			r.log.Debug("lease held elsewhere; will retry", "item", item, "took", took)
		case !ok:
			r.log.Debug("acquire failed too", "item", item, "err", err)
		case errors.Is(err, ErrBucketNew):
			r.nextAcquire = r.m.store.QuietUntil()
			r.wakeAt(r.nextAcquire)
			r.log.Info("not acquiring until the leases of the lost bucket have run out", "until", time.Until(r.nextAcquire).Round(time.Millisecond))
			ok = false
		default:
			r.backOff(acquireFailed, item, err)
			ok = false
		}
	}
	return ok
}

func (r *run) backOff(msg, item string, err error) {
	wait := r.acquireBO.NextBackOff()
	r.nextAcquire = time.Now().Add(wait)
	r.wakeAt(r.nextAcquire)
	r.m.repeats.Failed(context.Background(), r.log, slog.LevelWarn, msg, "item", item, "retry_in", wait, "err", err)
}

// wakeAt makes the loop reconcile at t (as well as every RenewEvery).
func (r *run) wakeAt(t time.Time) {
	r.wake.Reset(time.Until(t))
}

// acquire takes the lease on item, first deleting a term of this run that no
// work uses any more if one is in the way. It is not cut short by Run's ctx,
// so that shutdown does not leave an acquire unanswered: a lease acquired
// during shutdown is released at once by its claim. It touches none of the
// loop's state, so that take runs several at once. freedAt is the revision
// of the marker the watch last showed for the item's lease, or 0.
func (r *run) acquire(ctx context.Context, item string, freedAt uint64) (*Lease, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.RenewEvery)
	defer cancel()
	l, err := r.m.store.acquire(ctx, r.cfg.Group, item, r.cfg.MemberID, r.instance, freedAt)
	if !errors.Is(err, ErrHeld) {
		return l, err
	}
	reclaimed, rerr := r.m.store.reclaimOwn(ctx, r.cfg.Group, item, r.instance)
	if rerr != nil {
		return nil, rerr
	}
	if !reclaimed {
		return nil, err
	}
	r.log.Info("deleted an abandoned lease of this member", "item", item)
	return r.m.store.acquire(ctx, r.cfg.Group, item, r.cfg.MemberID, r.instance, 0)
}

// reclaim deletes this run's term on item, if there is one, and forgets that
// the item's acquire was unanswered.
func (r *run) reclaim(ctx context.Context, item string) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.RenewEvery)
	defer cancel()
	reclaimed, err := r.m.store.reclaimOwn(ctx, r.cfg.Group, item, r.instance)
	if err != nil {
		return err
	}
	delete(r.uncertain, item)
	if reclaimed {
		r.log.Info("deleted an abandoned lease of this member", "item", item)
	}
	return nil
}

// keepMembership writes the heartbeat and lists the members every
// RenewEvery, while the member is healthy. An unhealthy member deletes its
// heartbeat, so that the others take its items over, and writes none until
// it is healthy again. It also notices a lost bucket, creates it again, and
// has the watch follow a bucket created again by anyone.
func (r *run) keepMembership(ctx context.Context) {
	defer r.helpers.Done()
	failing, out := false, false
	var failingSince time.Time
	var known []string // the last listing
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-r.beatNow:
			t.Stop()
		}
		t.Reset(r.cfg.RenewEvery)
		if herr := r.health(); herr != nil {
			if !out {
				lctx, cancel := context.WithTimeout(ctx, r.cfg.RenewEvery)
				err := r.m.store.Leave(lctx, r.cfg.Group, r.cfg.MemberID)
				cancel()
				if err != nil && ctx.Err() == nil {
					r.log.Warn("leave the group while unhealthy (the heartbeat expires after TTL instead)", "err", err)
				}
				out = true
			}
			continue
		}
		out = false
		began := time.Now()
		list, err := r.beat(ctx, known)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			if !failing {
				failingSince = time.Now()
			}
			r.m.repeats.Failed(ctx, r.log, slog.LevelWarn, heartbeatFailing, "err", err)
			failing = true
			// A write to a deleted bucket fails like one to an unreachable
			// server (nats.go retries "no responders" until the deadline),
			// so ask the server whether the bucket exists.
			rctx, cancel := context.WithTimeout(ctx, r.cfg.RenewEvery)
			replaced, err := r.m.store.recreateIfMissing(rctx)
			cancel()
			switch {
			case err != nil:
				r.log.Debug("check the lease bucket", "err", err)
			case replaced:
				r.followBucket()
				t.Reset(0) // beat into the new bucket at once
			}
			continue
		}
		if failing {
			r.m.repeats.Over(ctx, r.log, heartbeatFailing)
			r.log.Debug("membership heartbeat recovered", "after", time.Since(failingSince))
			failing = false
		}
		rctx, cancel := context.WithTimeout(ctx, r.cfg.RenewEvery)
		if replaced, err := r.m.store.bucketReplaced(rctx); err == nil && replaced {
			r.log.Warn("the lease bucket was created again by another member")
			r.followBucket()
		}
		cancel()
		known = list
		select {
		case <-r.memberSet:
		default:
		}
		if hook := r.m.onListed; hook != nil {
			hook(list)
		}
		r.memberSet <- memberListing{members: list, began: began}
	}
}

// followBucket has the watch start again on the bucket now in the server:
// a watch on a deleted bucket sees nothing more, even once the bucket is
// created again.
func (r *run) followBucket() {
	select {
	case r.rewatch <- struct{}{}:
	default:
	}
}

// beat writes the heartbeat and lists the members. known is the previous
// listing: a member missing now is asked for directly, since a listing can
// miss a heartbeat rewritten while it runs, and a member dropped by mistake
// would move its items twice.
func (r *run) beat(ctx context.Context, known []string) ([]string, error) {
	bctx, cancel := context.WithTimeout(ctx, r.cfg.RenewEvery)
	defer cancel()
	if err := r.m.store.Heartbeat(bctx, r.cfg.Group, r.cfg.MemberID); err != nil {
		return nil, err
	}
	list, err := r.m.store.Members(bctx, r.cfg.Group)
	if err != nil {
		return nil, err
	}
	for _, id := range known {
		if slices.Contains(list, id) {
			continue
		}
		present, err := r.m.store.memberPresent(bctx, r.cfg.Group, id)
		if err != nil {
			return nil, err
		}
		if present {
			list = append(list, id)
		}
	}
	slices.Sort(list)
	return list, nil
}

// watch forwards membership and lease changes to the loop, re-creating the
// watch with backoff when it cannot be made or ends.
func (r *run) watch(ctx context.Context) {
	defer r.helpers.Done()
	bo := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(r.cfg.RenewEvery/4),
		backoff.WithMaxInterval(2*r.cfg.RenewEvery),
		backoff.WithMaxElapsedTime(0),
	)
	for ctx.Err() == nil {
		wctx, cancel := context.WithCancel(ctx)
		events, err := r.m.store.watchGroup(wctx, r.cfg.Group)
		if err == nil {
			bo.Reset()
			if r.forward(ctx, events) {
				cancel()
				continue // at once, on the new bucket
			}
			if ctx.Err() == nil {
				r.log.Debug("watch ended; re-creating")
			}
		} else {
			r.log.Debug("watch failed", "err", err)
		}
		cancel()
		select {
		case <-ctx.Done():
		case <-time.After(bo.NextBackOff()):
		}
	}
}

// forward passes events on to the loop until the watch ends, and reports
// whether it stopped because the bucket was created again.
func (r *run) forward(ctx context.Context, events <-chan event) (rewatch bool) {
	for {
		select {
		case ev, ok := <-events:
			if !ok {
				return false
			}
			select {
			case r.events <- ev:
			case <-ctx.Done():
				return false
			}
		case <-r.rewatch:
			return true
		case <-ctx.Done():
			return false
		}
	}
}

// pollItems calls items every PollItemsEvery and when asked, and hands the
// sorted, de-duplicated list to the loop.
func (r *run) pollItems(ctx context.Context) {
	defer r.helpers.Done()
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-r.pollNow:
		}
		list, err := r.items(ctx)
		if ctx.Err() != nil {
			return
		}
		t.Reset(r.cfg.PollItemsEvery)
		if err != nil {
			r.m.repeats.Failed(ctx, r.log, slog.LevelWarn, listItemsFailed, "err", err)
			continue
		}
		r.m.repeats.Over(ctx, r.log, listItemsFailed)
		list = slices.Clone(list)
		slices.Sort(list)
		list = slices.Compact(list)
		select {
		case <-r.itemList:
		default:
		}
		r.itemList <- list
	}
}

func newInstanceID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// The kinds of a manager's retried failures in its repeats.
const (
	acquireFailed    = "acquire failed; backing off"
	heartbeatFailing = "membership heartbeat failing"
	listItemsFailed  = "list items failed; keeping the previous list"
)
