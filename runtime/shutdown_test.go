package runtime_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/effects"
)

// Shutdown timing of the workers in TestShutdownHandsPartitionsOverAtOnce:
// kfn's defaults, so that a handoff bound by the lease TTL would show.
const (
	shutdownTTL   = 5 * time.Second
	shutdownRenew = time.Second
	// shutdownHandoff is the promise: every partition of a worker stopped
	// with SIGTERM is claimed by another worker within this long of the
	// signal.
	shutdownHandoff = time.Second
	// shutdownExit bounds the stopped worker's exit, from its settings:
	// the lanes roll their in-flight batch back at once (unless it is committing), but a handler that
	// ignores its ctx is abandoned only after a grace of 1 s, and its
	// session ended (a round trip of at most 5/4 of the statement timeout,
	// 0.4 × TTL by default); then the heartbeat and the lease keys are
	// deleted (round trips bounded by --lease-renew, the leases in
	// parallel).
	shutdownExit = time.Second + 5*(shutdownTTL*4/10)/4 + 2*shutdownRenew
)

// Two workers share 12 partitions under load; one is stopped with SIGTERM
// in the middle of a batch transaction. It must exit 0 within
// shutdownExit, and the other worker must claim each of its partitions
// within shutdownHandoff of the signal: the leases are deleted, not left
// to expire. Nothing is lost or applied twice.
func TestShutdownHandsPartitionsOverAtOnce(t *testing.T) {
	c := newCluster(t)
	timing := []string{"KFN_LEASE_TTL=" + shutdownTTL.String(), "KFN_LEASE_RENEW=" + shutdownRenew.String()}
	stopped := c.startWorkerEnv(c.nextID(), timing...)
	survivor := c.startWorkerEnv(c.nextID(), timing...)
	prod := c.startProducer()
	c.waitBalanced([]string{stopped.id, survivor.id}, 30*time.Second)
	time.Sleep(time.Second) // work a while under load

	before := ownedBy(c.cursors(), stopped.id)
	if len(before) != failoverPartitions/2 {
		t.Fatalf("%s owns %d partitions, want %d", stopped.id, len(before), failoverPartitions/2)
	}
	// The signal lands inside a batch transaction past its fence: frozen
	// there, signalled, then thawed, the worker must roll that batch back
	// (or finish it) before it lets the partition go.
	if !c.pauseInTransaction(stopped, "kfn.cursors", 30*time.Second) {
		t.Fatalf("could not catch %s inside a fenced transaction within 30s", stopped.id)
	}
	signalled := time.Now()
	if err := stopped.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	stopped.Resume()
	select {
	case <-stopped.Exited():
	case <-time.After(shutdownExit + 10*time.Second):
		t.Fatalf("%s did not exit within %s of SIGTERM; output:\n%s", stopped.id, shutdownExit+10*time.Second, stopped.LogTail(40))
	}
	exited := time.Since(signalled)
	if err := stopped.ExitErr(); err != nil {
		t.Errorf("%s exited with %v on SIGTERM, want status 0; output:\n%s", stopped.id, err, stopped.LogTail(40))
	}

	var claims map[int]time.Time
	waitUntil(t, 30*time.Second, survivor.id+" to claim every partition of "+stopped.id, func() (bool, string) {
		var err error
		if claims, err = effects.ClaimedAt(context.Background(), c.pg.Pool, c.fn, c.topic, survivor.id); err != nil {
			t.Fatal(err)
		}
		for p := range before {
			if _, ok := claims[p]; !ok {
				return false, fmt.Sprintf("partition %d not claimed by %s yet", p, survivor.id)
			}
		}
		return true, ""
	})
	var first, last time.Duration
	for i, p := range slices.Sorted(maps.Keys(before)) {
		d := claims[p].Sub(signalled)
		if i == 0 || d < first {
			first = d
		}
		last = max(last, d)
	}
	line := fmt.Sprintf("shutdown handoff (SIGTERM of 1 of 2 workers, %d records/s, lease TTL %s): exit 0 after %s; its %d partitions claimed by the other worker %s (first) to %s (last) after the signal",
		produceRate, shutdownTTL, exited.Round(time.Millisecond), len(before), first.Round(time.Millisecond), last.Round(time.Millisecond))
	t.Log(line)
	fmt.Println(line)
	if exited > shutdownExit {
		t.Errorf("%s took %s to exit after SIGTERM, over the bound %s", stopped.id, exited, shutdownExit)
	}
	if last > shutdownHandoff {
		t.Errorf("the last partition of %s was claimed %s after SIGTERM, over %s: the handoff waited for something (the TTL is %s)", stopped.id, last, shutdownHandoff, shutdownTTL)
	}

	// The other worker claimed each of those partitions once after the
	// signal (claims before it were the start's balancing): the departure
	// was not undone by a members listing that began before it (which
	// moved the partitions back and took them again, a handoff twice
	// over).
	var reclaimed []string
	for _, p := range slices.Sorted(maps.Keys(before)) {
		var n int
		err := c.pg.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kfn.audit_log
 WHERE action = 'claim' AND actor = $1 AND consumer = $2 AND topic = $3 AND partition = $4 AND at >= $5`, survivor.id, c.fn, c.topic, p, signalled).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			reclaimed = append(reclaimed, fmt.Sprintf("partition %d %d times", p, n))
		}
	}
	if len(reclaimed) > 0 {
		t.Errorf("%s claimed %s; want each partition of %s once", survivor.id, strings.Join(reclaimed, ", "), stopped.id)
	}

	// The worker logs the signal, what its lanes' batches in flight did,
	// the phases of its lease manager's stop and how long its shutdown
	// took, and its JSON log writes durations as text.
	var starting, signal, took, phases, inFlight int
	for _, e := range logSince(t, stopped, 0) {
		switch msg := e.str("msg"); {
		case msg == "lease manager starting":
			starting++
			if ttl, ok := e["ttl"].(string); !ok || ttl != shutdownTTL.String() {
				t.Errorf("log line %q has ttl %#v, want the string %q", msg, e["ttl"], shutdownTTL.String())
			}
		case strings.HasPrefix(msg, "stopping:"):
			signal++
			if cause := e.str("cause"); cause != "terminated signal received" {
				t.Errorf("log line %q has cause %q, want the SIGTERM", msg, cause)
			}
		case strings.HasPrefix(msg, "lane stopped: its batch in flight"):
			inFlight++
		case msg == "lease manager stopped" && e.str("function") == c.fn:
			phases++
			if e.str("released") != strconv.Itoa(len(before)) {
				t.Errorf("log line %q says %s leases released; want the %d partitions", msg, e.str("released"), len(before))
			}
			for _, k := range []string{"left_after", "work_returned_after", "released_after"} {
				if d, err := time.ParseDuration(e.str(k)); err != nil || d < 0 || d > exited {
					t.Errorf("log line %q has %s %q; want a duration up to the exit's %s", msg, k, e.str(k), exited)
				}
			}
			t.Logf("%s's partition leases: left the group %s after the signal, the last lane (partition %s) returned after %s, the last lease released after %s",
				stopped.id, e.str("left_after"), e.str("slowest_item"), e.str("work_returned_after"), e.str("released_after"))
		case msg == "worker stopped cleanly":
			took++
			if d, ok := e["shutdown_took"].(string); !ok {
				t.Errorf("log line %q has shutdown_took %#v, want a duration as a string", msg, e["shutdown_took"])
			} else if _, err := time.ParseDuration(d); err != nil {
				t.Errorf("log line %q: shutdown_took %q: %v", msg, d, err)
			}
		}
	}
	if starting == 0 || signal != 1 || took != 1 || phases != 1 || inFlight == 0 {
		t.Errorf("%s logged %d lease manager starting, %d stopping, %d lease manager stopped (of %s), %d lane stopped with a batch in flight and %d worker stopped cleanly lines; want at least 1, 1, 1, 1 (the SIGTERM came inside a batch) and 1",
			stopped.id, starting, signal, phases, c.fn, inFlight, took)
	}

	hw := c.finishProduction(prod)
	c.waitCaughtUp(hw, 60*time.Second)
	stopClean(t, survivor)
	c.check(hw)
}
