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
// offsets catch up afterwards.
func TestKillBetweenPostgresCommitAndKafkaOffsetCommit(t *testing.T) {
	c := newCluster(t)
	client := &kafka.Client{Addr: kafka.TCP(c.kafka.Brokers...), Timeout: 5 * time.Second}
	parts := make([]int, failoverPartitions)
	for i := range parts {
		parts[i] = i
	}
	// groupBehind reports whether some partition's Postgres cursor is ahead
	// of the group's committed offset (a missing group counts as 0).
	groupBehind := func() bool {
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
			if cur.next > max(committed[p], 0) {
				return true
			}
		}
		return false
	}

	worker := c.startWorker(c.nextID())
	prod := c.startProducer()
	killed := 0
	for deadline := time.Now().Add(30 * time.Second); killed < 3 && time.Now().Before(deadline); {
		time.Sleep(randomDuration(300*time.Millisecond, 900*time.Millisecond))
		if !groupBehind() {
			continue
		}
		worker.Kill()
		killed++
		worker = c.startWorker(c.nextID())
	}
	if killed < 3 {
		t.Fatalf("caught the worker between its Postgres commit and its Kafka offset commit only %d times in 30s", killed)
	}
	hw := c.finishProduction(prod)
	c.waitCaughtUp(hw, 60*time.Second)
	c.waitGroupCaughtUp(hw, 30*time.Second)
	stopClean(t, worker)
	c.check(hw)
}
