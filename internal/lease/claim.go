package lease

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// claim is the loop's handle on one held lease.
type claim struct {
	item     string
	token    uint64
	cancel   context.CancelCauseFunc
	stopping bool
}

// stop asks the claim's work to finish, with cause as its ctx's cause; the
// lease is released after it does.
func (c *claim) stop(log *slog.Logger, cause error) {
	if c.stopping {
		return
	}
	c.stopping = true
	log.Debug("stopping claim", "item", c.item, "token", c.token, "reason", cause)
	c.cancel(cause)
}

// errValidityRanOut is the cause of a claim's cancellation when no renewal
// succeeded within TTL-SafetyMargin.
var errValidityRanOut = errors.New("lease validity ran out: no renewal succeeded for TTL-SafetyMargin")

// startClaim runs the claim of a lease just acquired (in took).
func (r *run) startClaim(ctx context.Context, l *Lease, took time.Duration) {
	cctx, cancel := context.WithCancelCause(ctx)
	c := &claim{item: l.Item, token: l.Token, cancel: cancel}
	r.claims[l.Item] = c
	r.log.Debug("claimed", "item", l.Item, "token", l.Token, "took", took)
	r.claimWG.Add(1)
	go func() {
		defer r.claimWG.Done()
		end := r.hold(cctx, cancel, l)
		cancel(nil)
		select {
		case r.finished <- end:
		case <-r.stopped:
		}
	}()
}

// hold runs work on the claim, renews the lease until work returns, cancels
// work's ctx if the lease is lost, and then releases a still valid lease. It
// reports how the claim ended: whether work returned before its ctx was
// cancelled, and when it was asked to stop, returned and was released.
func (r *run) hold(ctx context.Context, cancel context.CancelCauseFunc, l *Lease) (end claimEnd) {
	log := r.log.With("item", l.Item, "token", l.Token)
	cfg := r.cfg
	end.item = l.Item
	stopAsked := make(chan time.Time, 1)
	defer context.AfterFunc(ctx, func() { stopAsked <- time.Now() })()

	// The watchdog cancels work when the validity runs out, whatever the
	// renewal loop is blocked on. Renewals only move validUntil forward; the
	// watchdog re-arms itself when it finds it moved.
	var mu sync.Mutex
	validUntil := l.ValidUntil()
	lost := false
	var watchdog *time.Timer
	mu.Lock()
	watchdog = time.AfterFunc(time.Until(validUntil), func() {
		mu.Lock()
		defer mu.Unlock()
		if lost {
			return
		}
		if rem := time.Until(validUntil); rem > 0 {
			watchdog.Reset(rem)
			return
		}
		lost = true
		log.Warn("lease lost: stopping work", "valid_until_passed_by", -time.Until(validUntil))
		cancel(errValidityRanOut)
	})
	mu.Unlock()
	defer watchdog.Stop()

	workCtx := ctx
	if freezeSet() { // tests only
		workCtx = cancelAfterFreeze(ctx, l)
	}
	workDone := make(chan struct{})
	go func() {
		defer close(workDone)
		r.work(workCtx, Claim{Item: l.Item, Token: l.Token})
	}()

	sentAt := func() time.Time { return l.ValidUntil().Add(-(cfg.TTL - cfg.SafetyMargin)) }
	next := time.NewTimer(time.Until(sentAt().Add(cfg.RenewEvery)))
	defer next.Stop()
	failing, unhealthy := false, false
renew:
	for {
		select {
		case <-workDone:
			break renew
		case <-next.C:
		}
		if thaw := frozen(l.Item, l.Token); thaw != nil {
			// Frozen by a test: renew nothing until the freeze ends.
			select {
			case <-workDone:
				break renew
			case <-thaw:
			}
		}
		if herr := r.health(); herr != nil {
			// An unhealthy member renews nothing: the work is stopped, and
			// the lease is released as soon as it returns, while still valid.
			if !unhealthy {
				r.m.repeats.Failed(ctx, log, slog.LevelWarn, "member unhealthy: not renewing; stopping work", "err", herr)
				unhealthy = true
			}
			cancel(fmt.Errorf("member unhealthy: %w", herr))
			next.Reset(cfg.RenewEvery / 4)
			continue
		}
		unhealthy = false
		rctx, rcancel := context.WithDeadline(context.Background(), minTime(time.Now().Add(cfg.RenewEvery), l.ValidUntil()))
		err := r.m.store.Renew(rctx, l)
		rcancel()
		switch {
		case err == nil:
			mu.Lock()
			if !lost {
				validUntil = l.ValidUntil()
			}
			mu.Unlock()
			if failing {
				r.m.repeats.Over(ctx, log, renewalFailing)
				failing = false
			}
			if hook := r.m.onRenewed; hook != nil {
				hook(l.Item, sentAt())
			}
			next.Reset(time.Until(sentAt().Add(cfg.RenewEvery)))
		case errors.Is(err, ErrLost):
			mu.Lock()
			wasLost := lost
			lost = true
			mu.Unlock()
			if !wasLost {
				log.Warn("lease lost: stopping work", "err", err)
			}
			cancel(err)
			<-workDone
			break renew
		default:
			r.m.repeats.Failed(ctx, log, slog.LevelWarn, renewalFailing, "valid_for", time.Until(l.ValidUntil()), "err", err)
			failing = true
			next.Reset(cfg.RenewEvery / 2)
		}
	}
	end.workReturned = time.Now()
	end.early = ctx.Err() == nil
	if !end.early {
		// Noted by a goroutine of its own, maybe after work noticed.
		end.stopAsked = minTime(<-stopAsked, end.workReturned)
	}

	mu.Lock()
	release := !lost
	mu.Unlock()
	if !release || !l.Valid() {
		log.Debug("claim ended; lease not released", "cause", context.Cause(ctx))
		return end
	}
	rctx, rcancel := context.WithTimeout(context.Background(), cfg.RenewEvery)
	defer rcancel()
	if err := r.m.store.Release(rctx, l); err != nil {
		log.Warn("release lease", "err", err)
		return end
	}
	end.released = time.Now()
	if end.early {
		log.Debug("released", "cause", "work returned")
	} else {
		log.Debug("released", "cause", context.Cause(ctx),
			"work_returned_after", end.workReturned.Sub(end.stopAsked), "released_after", end.released.Sub(end.stopAsked))
	}
	return end
}

// cancelAfterFreeze returns a context for the claim's work that is
// cancelled with ctx, except that while a test freezes the claim (with
// SetFreeze) the cancellation waits until the freeze ends.
func cancelAfterFreeze(ctx context.Context, l *Lease) context.Context {
	workCtx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	context.AfterFunc(ctx, func() {
		if thaw := frozen(l.Item, l.Token); thaw != nil {
			<-thaw
		}
		cancel(context.Cause(ctx))
	})
	return workCtx
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// renewalFailing is the kind of a failed renewal in the manager's repeats:
// the leases of a manager that cannot reach NATS say so once per step of
// its schedule, not once per lease and renewal.
const renewalFailing = "lease renewal failing; retrying until validity runs out"
