// Package faults holds hooks that tests of kfn's runtime packages set to
// stop the record path and the lease at exact points. Production code never
// sets them. Each hook is an atomic pointer: nil (the default) is a no-op,
// and passing an unset hook costs one atomic load.
package faults

import (
	"sync/atomic"

	"github.com/kfn-dev/kfn/inbox"
)

// LanePoint is a point of a lane's batch transaction where the lane hook
// is called.
type LanePoint int

const (
	// BeforeFence: the batch's transaction is open (the lane has fetched
	// the batch) and its fence statement is next.
	BeforeFence LanePoint = iota + 1
	// AfterFence: the fence statement succeeded; the transaction holds the
	// lock of the lane's cursor row until it ends.
	AfterFence
	// FenceRefused: Postgres refused the fence statement because a newer
	// owner's token is stored; the lane rolls back and stops.
	FenceRefused
)

func (p LanePoint) String() string {
	switch p {
	case BeforeFence:
		return "before-fence"
	case AfterFence:
		return "after-fence"
	case FenceRefused:
		return "fence-refused"
	}
	return "unknown"
}

// LaneHook is called by a lane's tracker (a Kafka partition's or a JetStream
// subject's) at each LanePoint of its fence, with the lane (lane.Consumer is
// the function) and the lane's fencing token. It runs on the lane's
// goroutine: a hook that blocks freezes the lane at that point, with its
// transaction open.
type LaneHook func(p LanePoint, lane inbox.Partition, token int64)

var laneHook atomic.Pointer[LaneHook]

// SetLaneHook installs h (nil removes the hook) and returns a function that
// puts the previous hook back.
func SetLaneHook(h LaneHook) (restore func()) {
	var next *LaneHook
	if h != nil {
		next = &h
	}
	prev := laneHook.Swap(next)
	return func() { laneHook.Store(prev) }
}

// Lane calls the lane hook, if one is set.
func Lane(p LanePoint, lane inbox.Partition, token int64) {
	if h := laneHook.Load(); h != nil {
		(*h)(p, lane, token)
	}
}

// LeaseFreeze says whether the lease claim on item with token is frozen:
// nil if it is not, or a channel that is closed when its freeze ends.
//
// While a claim is frozen, its holder (package lease) does not renew the
// lease, and nothing cancels the claim's work: not the watchdog when the
// lease's validity runs out, not a failed renewal, not a rebalance. Those
// cancellations reach the work when the freeze ends, as they reach a
// process woken from SIGSTOP whose lease expired while it slept. Combined
// with a LaneHook that blocks, it freezes a lane as such a process would
// be frozen, and wakes it with its next statement about to run.
type LeaseFreeze func(item string, token uint64) <-chan struct{}

var leaseFreeze atomic.Pointer[LeaseFreeze]

// SetLeaseFreeze installs f (nil removes it) and returns a function that
// puts the previous one back. Install it before the claims it is to freeze
// start: the work of a claim that started without one gets its
// cancellations at once, frozen or not.
func SetLeaseFreeze(f LeaseFreeze) (restore func()) {
	var next *LeaseFreeze
	if f != nil {
		next = &f
	}
	prev := leaseFreeze.Swap(next)
	return func() { leaseFreeze.Store(prev) }
}

// LeaseFreezeSet reports whether a LeaseFreeze is installed.
func LeaseFreezeSet() bool { return leaseFreeze.Load() != nil }

// LeaseFrozen asks the LeaseFreeze, if one is set, about the claim on item
// with token; nil means not frozen.
func LeaseFrozen(item string, token uint64) <-chan struct{} {
	if f := leaseFreeze.Load(); f != nil {
		return (*f)(item, token)
	}
	return nil
}
