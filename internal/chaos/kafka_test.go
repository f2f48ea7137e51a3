//go:build chaos

package chaos_test

import (
	"context"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// kafkaUnderTest is the Kafka the run uses: a cluster of 3 Apache Kafka
// broker processes (KRaft, replication factor 3, min.insync.replicas 2)
// when Java and Maven are here, or else the embedded broker, which has one
// broker and so cannot lose one.
type kafkaUnderTest struct {
	brokers     []string
	description string // said in the output
	noKill      string // why the broker-kill fault is skipped, for its row
	cluster     *kfntest.KafkaProcessCluster
	embedded    *kfntest.KafkaCluster
}

func startKafka(t *testing.T) *kafkaUnderTest {
	t.Helper()
	if kfntest.HaveJava() && !*embedded {
		c := kfntest.KafkaClusterProcesses(t, 3)
		return &kafkaUnderTest{brokers: c.Brokers(), cluster: c,
			description: "3 Apache Kafka brokers (KRaft, replication factor 3, min.insync.replicas 2)"}
	}
	why := "Java or Maven is missing"
	if *embedded {
		why = "--embedded-kafka"
	}
	k := kfntest.Kafka(t)
	u := &kafkaUnderTest{brokers: k.Brokers, embedded: k,
		description: "the embedded broker (" + why + "; one broker: the broker-kill fault is skipped)",
		noKill:      "skipped: one broker"}
	if !k.Embedded {
		u.description = "KFN_TEST_KAFKA_BROKERS " + k.Brokers[0] + " (" + why + "; not the run's to kill: the broker-kill fault is skipped)"
		u.noKill = "skipped: not the run's brokers"
	}
	return u
}

// createTopic creates the orders topic.
func (k *kafkaUnderTest) createTopic(t *testing.T, partitions int) string {
	t.Helper()
	if k.cluster == nil {
		return k.embedded.CreateTopic(t, partitions)
	}
	topic := kfntest.Name(t, "orders")
	k.cluster.CreateTopic(t, topic, partitions)
	return topic
}

// canKillBrokers says whether the broker-kill fault can run.
func (k *kafkaUnderTest) canKillBrokers() bool { return k.noKill == "" }

// killLeader SIGKILLs the broker leading partition of topic, waits, and
// starts it again; it returns the broker's id and when it died.
func (k *kafkaUnderTest) killLeader(t *testing.T, topic string, partition int, down time.Duration) (int, time.Time) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	id, err := k.cluster.Leader(ctx, topic, partition)
	if err != nil {
		t.Fatalf("leader of %s[%d]: %v", topic, partition, err)
	}
	if err := k.cluster.Kill(id); err != nil {
		t.Fatalf("kill Kafka broker %d: %v", id, err)
	}
	at := time.Now()
	time.Sleep(down)
	if err := k.cluster.Start(id); err != nil {
		t.Fatalf("start Kafka broker %d again: %v", id, err)
	}
	return id, at
}
