//go:build kafkacluster

// This file's test runs kfn workers on a real 3-node Apache Kafka cluster
// (kfntest.KafkaClusterProcesses: Java and Maven needed). It is behind the
// kafkacluster build tag so that the default test run does not start three
// JVMs: `go tool task test:kafka-cluster` and .ci/run run it.
package runtime_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// kafkaSessionTimeout is broker.session.timeout.ms of kafka.sh's cluster
// mode: how long the controller waits before it fences a silent broker and
// moves the leadership of its partitions.
const kafkaSessionTimeout = 4 * time.Second

// Three workers consume a topic with replication factor 3 under load, and
// the broker leading some of its partitions is SIGKILLed, then started
// again. The lanes keep their leases (no epoch changes: a Kafka failover is
// no reason to move a partition), follow the leadership to the surviving
// brokers, and apply every record exactly once. A lane stands still from
// the kill until it applies a record written after it: Kafka itself serves
// no new record for at least the broker session timeout (the controller must
// fence the dead broker first), and the lane follows within the lease TTL
// of Kafka serving its partition again. The consumer group's offsets (the
// mirror) catch up too. Then a worker and the broker leading one of its
// partitions are killed together: the other workers take its partitions
// over within the lease TTL of both the lease running out and Kafka serving
// the partition again.
func TestLivenessKafkaLeaderKilled(t *testing.T) {
	kc := kfntest.KafkaClusterProcesses(t, 3)
	c := newClusterOn(t, kc.Cluster())
	workers := c.startWorkers(3)
	prod := c.startProducer()
	c.waitBalanced(ids(workers), 60*time.Second)
	epochs := epochsOf(c.cursors())

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	victim, err := kc.Leader(ctx, c.topic, 0)
	if err != nil {
		t.Fatal(err)
	}
	led := map[int]bool{}
	for p := range failoverPartitions {
		id, err := kc.Leader(ctx, c.topic, p)
		if err != nil {
			t.Fatal(err)
		}
		led[p] = id == victim
	}

	// Every lane caught up, so a lane has moved on once it applies a record
	// written after the kill.
	prod.pause()
	c.waitCaughtUp(c.kafka.HighWatermarks(t, c.topic), 60*time.Second)
	before := c.cursors()
	prod.expectErrors.Store(true)
	if err := kc.Kill(victim); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	prod.resume()
	t.Logf("broker %d, leader of partitions %v, killed", victim, keysWhere(led, true))

	// When Kafka moved each of the killed broker's partitions to a new
	// leader, and when it served each partition again: its leader's high
	// watermark passed the lane's cursor (a record written after the kill
	// is readable). For the killed broker's partitions that waits for the
	// new leader (and for the producer to find it); for the others, for the
	// ISR to drop the dead follower, since acks=all waits for it.
	movedCh, readableCh := make(chan map[int]time.Duration, 1), make(chan map[int]time.Duration, 1)
	go func() { movedCh <- movedAfter(ctx, kc, c.topic, keysWhere(led, true), victim, killed) }()
	go func() { readableCh <- readableAfter(ctx, kc, c.topic, before, killed) }()
	stood := c.waitTakenOver(killed, before, func(old, cur cursor) bool { return true },
		"every lane to apply a record written after the kill")
	moved, readable := <-movedCh, <-readableCh
	if len(readable) != len(before) || len(moved) != len(keysWhere(led, true)) {
		t.Fatalf("within a minute of the kill, Kafka moved partitions %v of %v and served partitions %v again",
			slices.Sorted(maps.Keys(moved)), keysWhere(led, true), slices.Sorted(maps.Keys(readable)))
	}
	behind := map[bool]map[int]time.Duration{true: {}, false: {}}
	worstStood := map[bool]time.Duration{}
	var worstReadable time.Duration
	for p, d := range stood {
		behind[led[p]][p] = max(d-readable[p], 0)
		worstStood[led[p]] = max(worstStood[led[p]], d)
		worstReadable = max(worstReadable, readable[p])
	}
	line := fmt.Sprintf("Kafka leader killed: new leaders elected within %s, every partition served again within %s (broker session timeout %s); "+
		"lanes stood still from the kill: partitions it led %s at worst, the others %s",
		slices.Max(slices.Collect(maps.Values(moved))).Round(time.Millisecond), worstReadable.Round(time.Millisecond), kafkaSessionTimeout,
		worstStood[true].Round(time.Millisecond), worstStood[false].Round(time.Millisecond))
	t.Log(line)
	fmt.Println(line)
	// How long Kafka takes is Kafka's (and CPU contention stretches it);
	// kfn's part is how long a lane lags behind Kafka serving again.
	reportStillness(t, "Kafka leader killed, behind Kafka serving again, partitions it led", behind[true], failoverTTL)
	reportStillness(t, "Kafka leader killed, behind Kafka serving again, the other partitions", behind[false], failoverTTL)
	if now := epochsOf(c.cursors()); !maps.Equal(now, epochs) {
		t.Errorf("epochs changed over the Kafka failover: %v, before %v", now, epochs)
	}

	if err := kc.Start(victim); err != nil {
		t.Fatal(err)
	}
	t.Logf("broker %d back %s after the kill", victim, time.Since(killed).Round(time.Millisecond))
	time.Sleep(2 * time.Second) // the producer's writer finds the leaders again
	prod.expectErrors.Store(false)
	t.Logf("producer writes that failed during the failover: %d", prod.expected.Load())

	// A worker and the broker leading one of its partitions die together.
	// The other workers claim the worker's partitions once its leases run
	// out, and a claim reads the partition's offsets, from the new leader
	// once Kafka has one.
	waitUntil(t, 60*time.Second, "every replica to be in sync again", func() (bool, string) {
		if err := kc.InSync(ctx, c.topic); err != nil {
			return false, err.Error()
		}
		return true, ""
	})
	c.waitBalanced(ids(workers), 60*time.Second)
	dead, live := workers[0], workers[1:]
	owned := slices.Sorted(maps.Keys(ownedBy(c.cursors(), dead.id)))
	victim2, err := kc.Leader(ctx, c.topic, owned[0])
	if err != nil {
		t.Fatal(err)
	}
	prod.pause()
	c.waitCaughtUp(c.kafka.HighWatermarks(t, c.topic), 60*time.Second)
	before2 := ownedBy(c.cursors(), dead.id)
	logFrom := map[*proc]int64{}
	for _, w := range live {
		logFrom[w] = logSize(t, w)
	}
	prod.expectErrors.Store(true)
	dead.Kill()
	if err := kc.Kill(victim2); err != nil {
		t.Fatal(err)
	}
	killed2 := time.Now()
	prod.resume()
	t.Logf("worker %s (partitions %v) and broker %d (leader of partition %d) killed", dead.id, owned, victim2, owned[0])
	go func() { readableCh <- readableAfter(ctx, kc, c.topic, before2, killed2) }()
	stood2 := c.waitTakenOver(killed2, before2, func(old, cur cursor) bool { return cur.owner != dead.id && cur.epoch > old.epoch },
		"the other workers to claim each of "+dead.id+"'s partitions and apply a record written after the kills")
	readable2 := <-readableCh
	behind2 := map[int]time.Duration{}
	for p, d := range stood2 {
		r, ok := readable2[p]
		if !ok {
			t.Fatalf("Kafka did not serve partition %d again within a minute of the kills", p)
		}
		// A claim can succeed once the lease has run out (at most the TTL
		// after the kill) and Kafka serves the partition.
		behind2[p] = max(d-max(r, failoverTTL), 0)
	}
	t.Logf("the killed worker's partitions stood still for %v from the kills, Kafka served them again after %v", roundAll(stood2), roundAll(readable2))
	var retried []string
	for _, w := range live {
		for _, e := range logSince(t, w, logFrom[w]) {
			if e.str("msg") == "claim partition failed, retrying" {
				retried = append(retried, fmt.Sprintf("%s partition %s: %s", w.id, e.str("partition"), e.str("err")))
			}
		}
	}
	t.Logf("claims retried %d times meanwhile; first ones: %v", len(retried), retried[:min(len(retried), 3)])
	reportStillness(t, "worker and Kafka leader killed together, behind the lease running out and Kafka serving again", behind2, failoverTTL)
	if err := kc.Start(victim2); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second) // the producer's writer finds the leaders again
	prod.expectErrors.Store(false)

	requireAlive(t, live...)
	hw := c.finishProduction(prod)
	c.waitCaughtUp(hw, 60*time.Second)
	// The mirror to the consumer group recovers too: its coordinator may
	// have been on a killed broker.
	c.waitGroupCaughtUp(hw, 30*time.Second)
	stopClean(t, live...)
	c.check(hw)
}

// roundAll rounds each duration of m to the millisecond, for the log.
func roundAll(m map[int]time.Duration) map[int]time.Duration {
	out := make(map[int]time.Duration, len(m))
	for k, d := range m {
		out[k] = d.Round(time.Millisecond)
	}
	return out
}

// keysWhere lists the sorted keys of m whose value is v.
func keysWhere(m map[int]bool, v bool) []int {
	var out []int
	for k, x := range m {
		if x == v {
			out = append(out, k)
		}
	}
	slices.Sort(out)
	return out
}

// readableAfter returns, per partition of before, how long after since
// Kafka served a record past the partition's cursor in before: its
// leader's high watermark (fresh metadata, no client cache) passed it.
func readableAfter(ctx context.Context, kc *kfntest.KafkaProcessCluster, topic string, before map[int]cursor, since time.Time) map[int]time.Duration {
	return whenTrue(ctx, slices.Sorted(maps.Keys(before)), since, func(p int) bool {
		hw, err := leaderHighWatermark(ctx, kc.Brokers(), topic, p)
		return err == nil && hw > before[p].next
	})
}

// movedAfter returns, per partition, how long after since its leader was
// no longer the killed broker victim.
func movedAfter(ctx context.Context, kc *kfntest.KafkaProcessCluster, topic string, partitions []int, victim int, since time.Time) map[int]time.Duration {
	return whenTrue(ctx, partitions, since, func(p int) bool {
		id, err := kc.Leader(ctx, topic, p)
		return err == nil && id != victim
	})
}

// whenTrue polls cond for each of partitions every 20 ms and returns how
// long after since it first held, per partition; it gives up after a
// minute, leaving out the partitions it never held for.
func whenTrue(ctx context.Context, partitions []int, since time.Time, cond func(p int) bool) map[int]time.Duration {
	out := map[int]time.Duration{}
	deadline := time.Now().Add(time.Minute)
	for len(out) < len(partitions) && time.Now().Before(deadline) && ctx.Err() == nil {
		for _, p := range partitions {
			if _, done := out[p]; !done && cond(p) {
				out[p] = time.Since(since)
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return out
}

// leaderHighWatermark asks partition p's leader, as the first broker that
// answers names it, for the partition's high watermark.
func leaderHighWatermark(ctx context.Context, brokers []string, topic string, p int) (int64, error) {
	var errs []error
	for _, addr := range brokers {
		dctx, cancel := context.WithTimeout(ctx, time.Second)
		conn, err := kafka.DialLeader(dctx, "tcp", addr, topic, p)
		cancel()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		_ = conn.SetDeadline(time.Now().Add(time.Second))
		hw, err := conn.ReadLastOffset()
		conn.Close()
		if err == nil {
			return hw, nil
		}
		errs = append(errs, err)
	}
	return 0, errors.Join(errs...)
}
