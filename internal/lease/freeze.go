package lease

import "sync/atomic"

// Freeze is a test's hook that says whether the claim on item with token
// is frozen: nil if it is not, or a channel that is closed when its freeze
// ends. Production code never sets it; unset (the default), it costs one
// atomic load per renewal.
//
// While a claim is frozen, its holder does not renew the lease, and nothing
// cancels the claim's work: not the watchdog when the lease's validity runs
// out, not a failed renewal, not a rebalance. Those cancellations reach the
// work when the freeze ends, as they reach a process woken from SIGSTOP
// whose lease expired while it slept. Combined with a lane hook that blocks
// (package faults), it freezes a lane as such a process would be frozen,
// and wakes it with its next statement about to run.
type Freeze func(item string, token uint64) <-chan struct{}

var freeze atomic.Pointer[Freeze]

// SetFreeze installs f (nil removes it) and returns a function that puts
// the previous one back. Install it before the claims it is to freeze
// start: the work of a claim that started without one gets its
// cancellations at once, frozen or not.
func SetFreeze(f Freeze) (restore func()) {
	var next *Freeze
	if f != nil {
		next = &f
	}
	prev := freeze.Swap(next)
	return func() { freeze.Store(prev) }
}

// freezeSet reports whether a Freeze is installed.
func freezeSet() bool { return freeze.Load() != nil }

// frozen asks the Freeze, if one is set, about the claim on item with
// token; nil means not frozen.
func frozen(item string, token uint64) <-chan struct{} {
	if f := freeze.Load(); f != nil {
		return (*f)(item, token)
	}
	return nil
}
