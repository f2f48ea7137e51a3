package devstack

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

// These tests pin down the kafka-go calls the runtime makes, against kfake.

func startKafka(t *testing.T, opts KafkaOptions) *Kafka {
	t.Helper()
	start := time.Now()
	k, err := StartKafka(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("kfake up in %s at %v", time.Since(start), k.Brokers)
	t.Cleanup(k.Stop)
	return k
}

func createTopic(t *testing.T, broker, topic string, partitions int) {
	t.Helper()
	conn, err := kafka.Dial("tcp", broker)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctrl, err := conn.Controller()
	if err != nil {
		t.Fatal(err)
	}
	cc, err := kafka.Dial("tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	if err := cc.CreateTopics(kafka.TopicConfig{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1}); err != nil {
		t.Fatalf("create topic %s: %v", topic, err)
	}
}

func produce(t *testing.T, brokers []string, topic string, msgs ...kafka.Message) {
	t.Helper()
	w := &kafka.Writer{
		Addr:         kafka.TCP(brokers...),
		Topic:        topic,
		Balancer:     kafka.BalancerFunc(func(m kafka.Message, _ ...int) int { return m.Partition }),
		RequiredAcks: kafka.RequireAll,
		BatchTimeout: time.Millisecond,
	}
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatalf("produce: %v", err)
	}
}

func TestKafkaWithKafkaGo(t *testing.T) {
	k := startKafka(t, KafkaOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const topic, parts = "orders", 3
	createTopic(t, k.Brokers[0], topic, parts)

	conn, err := kafka.Dial("tcp", k.Brokers[0])
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ps, err := conn.ReadPartitions(topic)
	if err != nil {
		t.Fatal(err)
	}
	if len(ps) != parts {
		t.Fatalf("ReadPartitions: %d partitions, want %d", len(ps), parts)
	}
	for _, p := range ps {
		if p.Leader.Port == 0 {
			t.Errorf("partition %d has no leader: %+v", p.ID, p)
		}
	}

	// Explicit partitions: 5 records to partition 2, 1 to partition 0.
	var msgs []kafka.Message
	for i := range 5 {
		msgs = append(msgs, kafka.Message{Partition: 2, Key: []byte("k"), Value: []byte(fmt.Sprint("v", i))})
	}
	msgs = append(msgs, kafka.Message{Partition: 0, Value: []byte("zero")})
	produce(t, k.Brokers, topic, msgs...)

	client := &kafka.Client{Addr: kafka.TCP(k.Brokers...), Timeout: 10 * time.Second}
	lo, err := client.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{
		topic: {kafka.LastOffsetOf(0), kafka.LastOffsetOf(1), kafka.LastOffsetOf(2), kafka.FirstOffsetOf(2)},
	}})
	if err != nil {
		t.Fatal(err)
	}
	hw := map[int]int64{}
	for _, po := range lo.Topics[topic] {
		if po.Error != nil {
			t.Fatalf("ListOffsets partition %d: %v", po.Partition, po.Error)
		}
		if po.LastOffset >= 0 {
			hw[po.Partition] = po.LastOffset
		}
		if po.Partition == 2 && po.FirstOffset != -1 && po.FirstOffset != 0 {
			t.Errorf("first offset of partition 2 = %d, want 0", po.FirstOffset)
		}
	}
	if hw[0] != 1 || hw[1] != 0 || hw[2] != 5 {
		t.Errorf("high watermarks = %v, want map[0:1 1:0 2:5]", hw)
	}

	// A partition reader positioned with SetOffset starts exactly there.
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: k.Brokers, Topic: topic, Partition: 2, MaxWait: 50 * time.Millisecond})
	defer r.Close()
	if err := r.SetOffset(3); err != nil {
		t.Fatal(err)
	}
	for want := int64(3); want < 5; want++ {
		m, err := r.ReadMessage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if m.Offset != want || string(m.Value) != fmt.Sprint("v", want) || m.Partition != 2 {
			t.Fatalf("read partition %d offset %d value %q, want partition 2 offset %d value v%d", m.Partition, m.Offset, m.Value, want, want)
		}
	}

	// A plain offset commit (no group membership), then fetch it back.
	const group = "kfn-lag"
	oc, err := client.OffsetCommit(ctx, &kafka.OffsetCommitRequest{
		GroupID: group, GenerationID: -1,
		Topics: map[string][]kafka.OffsetCommit{topic: {{Partition: 2, Offset: 5}, {Partition: 0, Offset: 1}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range oc.Topics[topic] {
		if p.Error != nil {
			t.Fatalf("OffsetCommit partition %d: %v", p.Partition, p.Error)
		}
	}
	of, err := client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: {0, 1, 2}}})
	if err != nil {
		t.Fatal(err)
	}
	if of.Error != nil {
		t.Fatal(of.Error)
	}
	got := map[int]int64{}
	for _, p := range of.Topics[topic] {
		if p.Error != nil {
			t.Fatalf("OffsetFetch partition %d: %v", p.Partition, p.Error)
		}
		got[p.Partition] = p.CommittedOffset
	}
	if got[0] != 1 || got[1] != -1 || got[2] != 5 {
		t.Errorf("committed offsets = %v, want map[0:1 1:-1 2:5]", got)
	}

	// Known difference: for a group that never committed, Apache Kafka (4.4)
	// answers every partition with offset -1 and no error, while kfake fails
	// the whole group with GROUP_ID_NOT_FOUND. Callers must accept both.
	of, err = client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: "never-committed", Topics: map[string][]int{topic: {0}}})
	if err != nil {
		t.Fatal(err)
	}
	if !errors.Is(of.Error, kafka.GroupIdNotFound) {
		t.Errorf("kfake OffsetFetch of an unknown group: error %v, want GROUP_ID_NOT_FOUND (update the note above if kfake changed)", of.Error)
	}
}

func TestKafkaTopicCreation(t *testing.T) {
	t.Run("no auto-create by default", func(t *testing.T) {
		k := startKafka(t, KafkaOptions{})
		conn, err := kafka.Dial("tcp", k.Brokers[0])
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if ps, err := conn.ReadPartitions("missing"); err == nil && len(ps) > 0 {
			t.Fatalf("topic was auto-created: %v", ps)
		}
	})
	t.Run("auto-create when enabled", func(t *testing.T) {
		k := startKafka(t, KafkaOptions{AutoCreateTopics: true, DefaultPartitions: 4})
		w := &kafka.Writer{Addr: kafka.TCP(k.Brokers...), Topic: "auto", AllowAutoTopicCreation: true, BatchTimeout: time.Millisecond}
		defer w.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var err error
		for range 50 { // the first write may race the topic's creation
			if err = w.WriteMessages(ctx, kafka.Message{Value: []byte("x")}); err == nil {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil {
			t.Fatalf("write to auto-created topic: %v", err)
		}
		conn, err := kafka.Dial("tcp", k.Brokers[0])
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ps, err := conn.ReadPartitions("auto")
		if err != nil || len(ps) != 4 {
			t.Fatalf("auto-created topic has %d partitions (err %v), want 4", len(ps), err)
		}
	})
}

func TestKafkaRestartKeepsData(t *testing.T) {
	k := startKafka(t, KafkaOptions{DataDir: t.TempDir()})
	createTopic(t, k.Brokers[0], "durable", 2)
	produce(t, k.Brokers, "durable", kafka.Message{Partition: 1, Value: []byte("a")}, kafka.Message{Partition: 1, Value: []byte("b")})
	before := k.Brokers[0]
	if err := k.Restart(); err != nil {
		t.Fatal(err)
	}
	if k.Brokers[0] != before {
		t.Errorf("broker address changed on restart: %s -> %s", before, k.Brokers[0])
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: k.Brokers, Topic: "durable", Partition: 1, MaxWait: 50 * time.Millisecond})
	defer r.Close()
	m, err := r.ReadMessage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if m.Offset != 0 || string(m.Value) != "a" {
		t.Errorf("after restart read offset %d %q, want offset 0 \"a\"", m.Offset, m.Value)
	}

	mem := startKafka(t, KafkaOptions{})
	if err := mem.Restart(); err == nil {
		t.Error("Restart of an in-memory cluster succeeded; it should refuse to lose data")
	}
}
