//go:build kafkacluster

// This file's test starts a real 3-node Apache Kafka cluster (Java and
// Maven needed); it is behind the kafkacluster build tag so that the
// default test run does not start three JVMs: `go tool task
// test:kafka-cluster` and .ci/run run it.
package kfntest

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

// A partition's leader is killed: another node leads it within a few
// seconds, writes acknowledged by all in-sync replicas go on with two of
// three nodes, and the node comes back on its port with its data.
func TestKafkaClusterProcessesSurviveALeaderKill(t *testing.T) {
	c := KafkaClusterProcesses(t, 3)
	if got := len(c.Brokers()); got != 3 {
		t.Fatalf("Brokers() = %v, want 3 addresses", c.Brokers())
	}
	topic := Name(t, "topic")
	c.CreateTopic(t, topic, 3)
	k := c.Cluster()
	write := func(first, n int) {
		t.Helper()
		msgs := make([]kafka.Message, n)
		for i := range msgs {
			msgs[i] = kafka.Message{Partition: (first + i) % 3, Value: []byte(strconv.Itoa(first + i))}
		}
		k.Produce(t, topic, msgs...)
	}
	write(0, 30)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	leader, err := c.Leader(ctx, topic, 0)
	if err != nil {
		t.Fatal(err)
	}
	if leader < 1 || leader > 3 {
		t.Fatalf("Leader = %d, want a node id 1..3", leader)
	}
	if err := c.Kill(leader); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	if err := c.Kill(leader); err == nil {
		t.Errorf("a second Kill(%d) of a dead node succeeded", leader)
	}
	var now int
	waitFor(t, 30*time.Second, func() bool {
		now, err = c.Leader(ctx, topic, 0)
		return err == nil && now != leader
	})
	t.Logf("node %d killed: node %d leads partition 0 after %s", leader, now, time.Since(killed).Round(time.Millisecond))

	if err := c.InSync(ctx, topic); err == nil {
		t.Errorf("InSync says every replica is in sync with node %d dead", leader)
	}

	write(30, 30) // acks=all with min.insync.replicas 2: two nodes suffice
	if err := c.Start(leader); err != nil {
		t.Fatal(err)
	}
	if err := c.Start(leader); err == nil {
		t.Errorf("a second Start(%d) of a running node succeeded", leader)
	}
	if err := c.Kill(0); err == nil {
		t.Error("Kill(0) succeeded; node ids start at 1")
	}
	write(60, 30)
	var total int64
	for p, hw := range k.HighWatermarks(t, topic) {
		if hw != 30 {
			t.Errorf("partition %d holds %d records, want 30", p, hw)
		}
		total += hw
	}
	if total != 90 {
		t.Errorf("the topic holds %d records, want 90", total)
	}

	// The restarted node caught up with the records written while it was
	// down: every replica is in sync again.
	waitFor(t, 60*time.Second, func() bool { return c.InSync(ctx, topic) == nil })
}
