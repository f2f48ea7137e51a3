package kfntest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"

	"github.com/kfn-dev/kfn/internal/devstack"
)

// EnvKafkaBrokers names real Kafka brokers for the tests; see the package doc.
const EnvKafkaBrokers = "KFN_TEST_KAFKA_BROKERS"

// topicReadyTimeout bounds how long CreateTopic waits for leaders; a real
// KRaft broker usually needs well under a second.
const topicReadyTimeout = 30 * time.Second

// KafkaCluster is the Kafka cluster shared by the test binary. Tests keep
// apart by creating their own topics with CreateTopic.
type KafkaCluster struct {
	// Brokers are the bootstrap addresses.
	Brokers []string
	// Embedded is true for the in-process kfake broker, false for brokers
	// from KFN_TEST_KAFKA_BROKERS.
	Embedded bool

	client    *kafka.Client
	transport *kafka.Transport
	replicas  int // the replication factor of CreateTopic's topics; 0 means 1
	// throwaway is set when the cluster dies with the test: its topics are
	// not deleted at the end.
	throwaway bool
}

var kafkaOnce struct {
	sync.Once
	k   *KafkaCluster
	err error
}

// Kafka returns the shared cluster: KFN_TEST_KAFKA_BROKERS if set,
// else an in-process kfake broker started once per test binary (topics are
// created only on request, as on a broker with auto.create.topics.enable=false).
func Kafka(t testing.TB) *KafkaCluster {
	t.Helper()
	if os.Getenv(EnvKafkaBrokers) == "" {
		requireMain(t, "kfntest.Kafka (in-process Kafka broker)")
	}
	kafkaOnce.Do(func() { kafkaOnce.k, kafkaOnce.err = startSharedKafka() })
	if kafkaOnce.err != nil {
		t.Fatalf("kfntest: %v", kafkaOnce.err)
	}
	return kafkaOnce.k
}

func startSharedKafka() (*KafkaCluster, error) {
	k := &KafkaCluster{transport: &kafka.Transport{DialTimeout: 5 * time.Second, IdleTimeout: 30 * time.Second}}
	if env := os.Getenv(EnvKafkaBrokers); env != "" {
		for _, b := range strings.Split(env, ",") {
			if b = strings.TrimSpace(b); b != "" {
				k.Brokers = append(k.Brokers, b)
			}
		}
		if len(k.Brokers) == 0 {
			return nil, fmt.Errorf("%s=%q holds no broker address; want host:port[,host:port…]", EnvKafkaBrokers, env)
		}
		desc, err := describeBroker(k.Brokers)
		if err != nil {
			return nil, fmt.Errorf("%s=%s: %w", EnvKafkaBrokers, env, err)
		}
		announce("Kafka from %s: %s", EnvKafkaBrokers, desc)
	} else {
		dk, err := devstack.StartKafka(devstack.KafkaOptions{Logger: logger})
		if err != nil {
			return nil, fmt.Errorf("start in-process Kafka (or set %s): %w", EnvKafkaBrokers, err)
		}
		onShutdown(dk.Stop)
		k.Brokers, k.Embedded = dk.Brokers, true
	}
	k.client = &kafka.Client{Addr: kafka.TCP(k.Brokers...), Timeout: 10 * time.Second, Transport: k.transport}
	onShutdown(k.transport.CloseIdleConnections)
	return k, nil
}

// describeBroker dials the first reachable broker and reports the cluster's
// brokers, its controller and the API versions the broker supports.
func describeBroker(brokers []string) (string, error) {
	var errs []error
	for _, addr := range brokers {
		conn, err := kafka.DialContext(context.Background(), "tcp", addr)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		versions, err := conn.ApiVersions()
		if err != nil {
			return "", fmt.Errorf("ApiVersions from %s: %w", addr, err)
		}
		all, err := conn.Brokers()
		if err != nil {
			return "", fmt.Errorf("metadata from %s: %w", addr, err)
		}
		ctrl, _ := conn.Controller()
		var bs []string
		for _, b := range all {
			bs = append(bs, fmt.Sprintf("%d@%s", b.ID, net.JoinHostPort(b.Host, strconv.Itoa(b.Port))))
		}
		var vs []string
		for _, v := range versions {
			vs = append(vs, fmt.Sprintf("%s %d-%d", protocol.ApiKey(v.ApiKey), v.MinVersion, v.MaxVersion))
		}
		return fmt.Sprintf("bootstrap %s; brokers %s; controller %d; API versions: %s",
			addr, strings.Join(bs, ", "), ctrl.ID, strings.Join(vs, ", ")), nil
	}
	return "", fmt.Errorf("no broker reachable: %w", errors.Join(errs...))
}

// CreateTopic creates a topic with a unique name and the given number of
// partitions (replication factor 1; 3 on a KafkaProcessCluster), waits
// until every partition has a leader and answers ListOffsets, and deletes
// the topic when the test ends (not on a KafkaProcessCluster, which dies
// with the test).
func (k *KafkaCluster) CreateTopic(t testing.TB, partitions int) string {
	t.Helper()
	topic := Name(t, "topic")
	k.CreateTopicNamed(t, topic, partitions)
	return topic
}

// CreateTopicNamed is CreateTopic for a name the test chose, for example
// one a worker was started on before the topic existed.
func (k *KafkaCluster) CreateTopicNamed(t testing.TB, topic string, partitions int) {
	t.Helper()
	if partitions < 1 {
		t.Fatalf("kfntest: CreateTopic: partitions = %d, want at least 1", partitions)
	}
	ctx, cancel := context.WithTimeout(context.Background(), topicReadyTimeout)
	defer cancel()
	resp, err := k.client.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{
		Topic: topic, NumPartitions: partitions, ReplicationFactor: max(k.replicas, 1),
	}}})
	if err == nil {
		err = resp.Errors[topic]
	}
	if err != nil {
		t.Fatalf("kfntest: create topic %s with %d partitions on %v: %v", topic, partitions, k.Brokers, err)
	}
	if !k.throwaway {
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			resp, err := k.client.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: []string{topic}})
			if err == nil {
				err = resp.Errors[topic]
			}
			if err != nil && !errors.Is(err, kafka.UnknownTopicOrPartition) {
				t.Logf("kfntest: delete topic %s: %v", topic, err)
			}
		})
	}
	if err := k.waitTopicReady(ctx, topic, partitions); err != nil {
		t.Fatalf("kfntest: topic %s did not become ready: %v", topic, err)
	}
}

// waitTopicReady polls until the topic has all its partitions, each with a
// leader, and ListOffsets succeeds for each of them. A real broker answers
// metadata before the partitions' leaders are elected.
func (k *KafkaCluster) waitTopicReady(ctx context.Context, topic string, partitions int) error {
	var last error
	for {
		last = k.topicReady(ctx, topic, partitions)
		if last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("after %s: %w", topicReadyTimeout, last)
		case <-time.After(25 * time.Millisecond):
		}
	}
}

func (k *KafkaCluster) topicReady(ctx context.Context, topic string, partitions int) error {
	ids, err := k.partitions(ctx, topic)
	if err != nil {
		return err
	}
	if len(ids) != partitions {
		return fmt.Errorf("metadata shows %d partitions, want %d", len(ids), partitions)
	}
	_, err = k.listOffsets(ctx, topic, ids)
	return err
}

// partitions returns the topic's partition ids; it fails while any partition
// has no leader.
func (k *KafkaCluster) partitions(ctx context.Context, topic string) ([]int, error) {
	md, err := k.client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return nil, fmt.Errorf("metadata: %w", err)
	}
	for _, tm := range md.Topics {
		if tm.Name != topic {
			continue
		}
		if tm.Error != nil {
			return nil, fmt.Errorf("metadata: %w", tm.Error)
		}
		var ids []int
		for _, p := range tm.Partitions {
			if p.Error != nil {
				return nil, fmt.Errorf("metadata of partition %d: %w", p.ID, p.Error)
			}
			if p.Leader.ID < 0 || p.Leader.Host == "" {
				return nil, fmt.Errorf("partition %d has no leader yet", p.ID)
			}
			ids = append(ids, p.ID)
		}
		sort.Ints(ids)
		return ids, nil
	}
	return nil, fmt.Errorf("topic %s not in metadata", topic)
}

// listOffsets returns each partition's high watermark (the next offset).
func (k *KafkaCluster) listOffsets(ctx context.Context, topic string, ids []int) (map[int]int64, error) {
	reqs := make([]kafka.OffsetRequest, len(ids))
	for i, id := range ids {
		reqs[i] = kafka.LastOffsetOf(id)
	}
	resp, err := k.client.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	if err != nil {
		return nil, fmt.Errorf("list offsets: %w", err)
	}
	out := make(map[int]int64, len(ids))
	for _, po := range resp.Topics[topic] {
		if po.Error != nil {
			return nil, fmt.Errorf("list offsets of partition %d: %w", po.Partition, po.Error)
		}
		out[po.Partition] = po.LastOffset
	}
	for _, id := range ids {
		if _, ok := out[id]; !ok {
			return nil, fmt.Errorf("list offsets: no answer for partition %d", id)
		}
	}
	return out, nil
}

// Produce writes msgs to topic synchronously, each to exactly its
// msg.Partition, in order, with acks from all in-sync replicas.
func (k *KafkaCluster) Produce(t testing.TB, topic string, msgs ...kafka.Message) {
	t.Helper()
	if len(msgs) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ids, err := k.partitions(ctx, topic)
	if err != nil {
		t.Fatalf("kfntest: produce to %s: %v", topic, err)
	}
	out := make([]kafka.Message, len(msgs))
	for i, m := range msgs {
		if m.Topic != "" && m.Topic != topic {
			t.Fatalf("kfntest: produce to %s: message %d names topic %q", topic, i, m.Topic)
		}
		if m.Partition < 0 || m.Partition >= len(ids) {
			t.Fatalf("kfntest: produce to %s: message %d is for partition %d, but the topic has partitions 0..%d", topic, i, m.Partition, len(ids)-1)
		}
		m.Topic = ""
		out[i] = m
	}
	w := &kafka.Writer{
		Addr:         kafka.TCP(k.Brokers...),
		Topic:        topic,
		Balancer:     kafka.BalancerFunc(func(m kafka.Message, _ ...int) int { return m.Partition }),
		RequiredAcks: kafka.RequireAll,
		BatchSize:    len(out),
		BatchTimeout: time.Millisecond,
		Transport:    k.transport,
	}
	defer w.Close()
	if err := w.WriteMessages(ctx, out...); err != nil {
		t.Fatalf("kfntest: produce %d messages to %s: %v", len(out), topic, err)
	}
}

// HighWatermarks returns each partition's high watermark: the offset the next
// produced record will get.
func (k *KafkaCluster) HighWatermarks(t testing.TB, topic string) map[int]int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	hw, err := k.ReadHighWatermarks(ctx, topic)
	if err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	return hw
}

// ReadHighWatermarks is HighWatermarks returning its error, for tests that
// wait for a broker to come back.
func (k *KafkaCluster) ReadHighWatermarks(ctx context.Context, topic string) (map[int]int64, error) {
	ids, err := k.partitions(ctx, topic)
	if err != nil {
		return nil, fmt.Errorf("high watermarks of %s: %w", topic, err)
	}
	hw, err := k.listOffsets(ctx, topic, ids)
	if err != nil {
		return nil, fmt.Errorf("high watermarks of %s: %w", topic, err)
	}
	return hw, nil
}
