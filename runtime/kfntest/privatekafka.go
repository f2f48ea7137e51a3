package kfntest

import (
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/devstack"
)

// PrivateKafka is an in-process Kafka broker of one test's own, keeping its
// data on disk, for fault tests that stop and start Kafka: the shared
// cluster must stay up for the other tests. It is the embedded broker even
// when KFN_TEST_KAFKA_BROKERS names real ones.
type PrivateKafka struct {
	*KafkaCluster
	broker *devstack.Kafka
}

// NewPrivateKafka starts a private broker on a free port and stops it when
// the test ends.
func NewPrivateKafka(t testing.TB) *PrivateKafka {
	t.Helper()
	broker, err := devstack.StartKafka(devstack.KafkaOptions{DataDir: t.TempDir(), Logger: logger})
	if err != nil {
		t.Fatalf("kfntest: start a private Kafka broker: %v", err)
	}
	t.Cleanup(broker.Stop)
	transport := &kafka.Transport{DialTimeout: 5 * time.Second, IdleTimeout: 30 * time.Second}
	t.Cleanup(transport.CloseIdleConnections)
	return &PrivateKafka{
		KafkaCluster: &KafkaCluster{
			Brokers: broker.Brokers, Embedded: true, transport: transport,
			client: &kafka.Client{Addr: kafka.TCP(broker.Brokers...), Timeout: 10 * time.Second, Transport: transport},
		},
		broker: broker,
	}
}

// Stop shuts the broker down: clients' connections close and new ones are
// refused, until Start.
func (k *PrivateKafka) Stop() { k.broker.Stop() }

// Start starts the stopped broker again on the same port, with its topics,
// records and committed offsets.
func (k *PrivateKafka) Start() error { return k.broker.Start() }
