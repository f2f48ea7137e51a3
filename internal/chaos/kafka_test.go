//go:build chaos

package chaos_test

import (
	"testing"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// kafkaUnderTest is the Kafka the run uses: a cluster of 3 Apache Kafka
// broker processes when Java is here, or else the embedded broker, which
// has one broker and so cannot lose one.
type kafkaUnderTest struct {
	brokers     []string
	description string // said in the output
	noKill      string // why the broker-kill fault is skipped, for its row
	embedded    *kfntest.KafkaCluster
}

func startKafka(t *testing.T) *kafkaUnderTest {
	t.Helper()
	k := kfntest.Kafka(t)
	u := &kafkaUnderTest{brokers: k.Brokers, embedded: k,
		description: "the embedded broker (Java is missing; one broker: the broker-kill fault is skipped)",
		noKill:      "skipped: the embedded Kafka is one broker"}
	if !k.Embedded {
		u.description = "KFN_TEST_KAFKA_BROKERS " + k.Brokers[0] + " (not the run's to kill: the broker-kill fault is skipped)"
		u.noKill = "skipped: KFN_TEST_KAFKA_BROKERS is not the run's to kill"
	}
	return u
}

// createTopic creates the orders topic.
func (k *kafkaUnderTest) createTopic(t *testing.T, partitions int) string {
	t.Helper()
	return k.embedded.CreateTopic(t, partitions)
}

// canKillBrokers says whether the broker-kill fault can run.
func (k *kafkaUnderTest) canKillBrokers() bool { return k.noKill == "" }
