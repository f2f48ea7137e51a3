package runtime_test

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// The key-lane fault tests: effects-worker processes run each partition as
// 16 key-lanes (KFN_KEY_CONCURRENCY=16) over a topic of 2 partitions whose
// records are spread over 64 keys each, with a per-key sequence number in
// every value. They end with production stopped, the cursors at the high
// watermarks and the checker's counts at zero: nothing lost, nothing
// applied twice, and per key, in commit order, the sequence numbers in
// order (effects.KeyOrder), every effect committed under the token of its
// partition's owner at the time, by a transaction that held its key-lane's
// fence.
const (
	keyLanePartitions = 2
	keyLaneCount      = 16
	keyLaneKeys       = 64
)

func newKeyLaneCluster(t *testing.T) *cluster {
	t.Helper()
	c := newClusterWith(t, kfntest.Kafka(t), keyLanePartitions)
	c.keyLanes, c.keys = keyLaneCount, keyLaneKeys
	return c
}

// An owner is SIGKILLed while one of its key-lanes is inside a transaction
// past its fence (frozen there, then killed), five times, and restarted
// under a new id. Its other key-lanes have committed records above the
// cursor, which waits on the uncommitted prefix: the next owner resumes at
// the cursor, skips what the inbox holds above it, and applies the rest.
// Each time, how long the victim's partition stood still (from the kill to
// the new owner's first cursor move there) is measured against the lease
// TTL.
func TestKeyLanesKillOwnerMidCommit(t *testing.T) {
	c := newKeyLaneCluster(t)
	workers := c.startWorkers(2)
	prod := c.startProducer()
	c.waitBalanced(ids(workers), 30*time.Second)

	const kills = 5
	const stallBound = 5 * failoverTTL
	var stalls []time.Duration
	for i := range kills {
		time.Sleep(randomDuration(300*time.Millisecond, 1500*time.Millisecond))
		requireAlive(t, workers...)
		vi, killed := c.killInKeyLaneTransaction(workers, 30*time.Second)
		victim := workers[vi]
		before := ownedBy(c.cursors(), victim.id)
		var stall time.Duration
		waitFor(t, stallBound+10*time.Second, "a new owner to move the cursor of one of "+victim.id+"'s partitions", func() bool {
			curs := c.cursors()
			for p, old := range before {
				if cur := curs[p]; cur.owner != victim.id && cur.committed && cur.next > old.next {
					stall = time.Since(killed)
					return true
				}
			}
			return false
		})
		stalls = append(stalls, stall)
		t.Logf("kill %d: SIGKILL %s inside a key-lane's fenced transaction (partitions %v); a new owner moved the cursor %s later",
			i+1, victim.id, slices.Sorted(maps.Keys(before)), stall.Round(time.Millisecond))
		workers[vi] = c.startWorker(c.nextID())
		c.waitBalanced(ids(workers), 30*time.Second)
	}
	slices.Sort(stalls)
	line := fmt.Sprintf("key-lanes (%d per partition): partition stood still after a SIGKILL mid-commit: median %s, max %s over %d kills (lease TTL %s, renew %s)",
		keyLaneCount, stalls[len(stalls)/2].Round(time.Millisecond), stalls[len(stalls)-1].Round(time.Millisecond), len(stalls), failoverTTL, failoverRenew)
	t.Log(line)
	fmt.Println(line)
	if worst := stalls[len(stalls)-1]; worst > stallBound {
		t.Errorf("a partition stood still %s after its owner was killed, over the liveness bound %s (5×TTL): %v", worst, stallBound, stalls)
	}

	hw := c.finishProduction(prod)
	c.waitCaughtUp(hw, 60*time.Second)
	stopClean(t, workers...)
	c.check(hw)
}

// killInKeyLaneTransaction is killInTransaction for workers with
// key-lanes: it SIGKILLs one of ps while it is inside a key-lane's
// transaction that has passed its fence (it holds a kfn.key_lanes row's
// lock), and returns the victim's index and when it was frozen.
func (c *cluster) killInKeyLaneTransaction(ps []*proc, limit time.Duration) (int, time.Time) {
	c.t.Helper()
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) {
		for _, i := range rand.Perm(len(ps)) {
			if frozen, ok := c.freezeInTransaction(ps[i], "kfn.key_lanes", 2*time.Second); ok {
				ps[i].Kill()
				return i, frozen
			}
		}
	}
	c.t.Fatalf("caught none of %v inside a key-lane's fenced transaction within %s", ids(ps), limit)
	return 0, time.Time{}
}
