package runtime_test

import (
	"context"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

// TestKillBetweenPostgresCommitAndKafkaOffsetCommit SIGKILLs a worker
// process at a moment when Postgres has committed records whose offsets the
// Kafka consumer group has not been told about yet (kfn mirrors them
// asynchronously, once a second). The restarted worker must resume at the
// Postgres cursor: nothing lost, nothing applied twice, and the group's
// offsets catch up afterwards. Resuming at the group offset instead would
// apply nothing twice either, because the high-water mark skips what was
// committed; so the test also requires that no worker skipped anything as
// handled before (the duplicate count each process reports): a resume at
// the cursor reads nothing twice.
func TestKillBetweenPostgresCommitAndKafkaOffsetCommit(t *testing.T) {
	c := newCluster(t)
	client := &kafka.Client{Addr: kafka.TCP(c.kafka.Brokers...), Timeout: 5 * time.Second}
	parts := make([]int, failoverPartitions)
	for i := range parts {
		parts[i] = i
	}
	// groupBehind reports whether worker id has committed on some partition
	// in Postgres beyond the group's committed offset (a missing group
	// counts as 0): killing it now loses the offset commit, not the work.
	groupBehind := func(id string) bool {
		committed := map[int]int64{}
		resp, err := client.OffsetFetch(context.Background(), &kafka.OffsetFetchRequest{GroupID: c.fn, Topics: map[string][]int{c.topic: parts}})
		if err == nil {
			for _, op := range resp.Topics[c.topic] {
				if op.Error == nil {
					committed[op.Partition] = op.CommittedOffset
				}
			}
		}
		for p, cur := range c.cursors() {
			if cur.owner == id && cur.committed && cur.next > max(committed[p], 0) {
				return true
			}
		}
		return false
	}

	worker := c.startWorker(c.nextID())
	prod := c.startProducer()
	killed := 0
	var duplicates int64 // records the workers skipped as handled before
	for deadline := time.Now().Add(60 * time.Second); killed < 3 && time.Now().Before(deadline); {
		time.Sleep(randomDuration(300*time.Millisecond, 900*time.Millisecond))
		if !groupBehind(worker.id) {
			continue
		}
		// Its count so far: a worker that resumed at the group offset
		// skips the re-read records in its first batches, long before this.
		duplicates += c.duplicates(worker)
		worker.Kill()
		killed++
		t.Logf("kill %d: SIGKILL %s with Postgres ahead of the group's offsets", killed, worker.id)
		worker = c.startWorker(c.nextID())
	}
	if killed < 3 {
		t.Fatalf("caught the worker between its Postgres commit and its Kafka offset commit only %d times in 60s", killed)
	}
	hw := c.finishProduction(prod)
	c.waitCaughtUp(hw, 60*time.Second)
	c.waitGroupCaughtUp(hw, 30*time.Second)
	duplicates += c.duplicates(worker)
	stopClean(t, worker)
	if duplicates != 0 {
		t.Errorf("the workers skipped %d records as handled before; resuming at the Postgres cursor after a kill reads none twice", duplicates)
	}
	c.check(hw)
}
