// Package faults holds the hooks that tests of kfn's runtime packages set to
// stop a lane's record path at exact points of its fence. Production code
// never sets them. Each hook is an atomic pointer: nil (the default) is a
// no-op, and passing an unset hook costs one atomic load. The lease's own
// hook, which freezes a claim, is package lease's SetFreeze: the lease
// knows nothing of lanes or the inbox.
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
