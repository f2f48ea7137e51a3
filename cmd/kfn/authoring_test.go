package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// readAll reads every record of topic's partition p.
func readAll(t *testing.T, brokers []string, topic string, p int, n int) []kafka.Message {
	t.Helper()
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: p, MinBytes: 1, MaxBytes: 1 << 20})
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out []kafka.Message
	for len(out) < n {
		m, err := r.ReadMessage(ctx)
		if err != nil {
			t.Fatalf("read %s/%d after %d records: %v", topic, p, len(out), err)
		}
		out = append(out, m)
	}
	return out
}

func TestTopicCommands(t *testing.T) {
	k := kfntest.Kafka(t)
	brokers := "--kafka-brokers=" + strings.Join(k.Brokers, ",")
	topic := kfntest.Name(t, "payments")
	if code, out, errOut := kfn(t, "topic", "create", topic, "--partitions", "3", brokers); code != 0 || !strings.Contains(out, "created topic "+topic+" with 3 partitions") {
		t.Fatalf("topic create: exit %d, %q %q", code, out, errOut)
	}
	if code, _, errOut := kfn(t, "topic", "create", topic, brokers); code != 1 || !strings.Contains(errOut, "already exists") {
		t.Errorf("creating it again: exit %d, %q; want 1 saying it exists", code, errOut)
	}
	if code, out, errOut := kfn(t, "topic", "create", topic, "--if-not-exists", brokers); code != 0 || !strings.Contains(out, "exists already") {
		t.Errorf("creating it again with --if-not-exists: exit %d, %q %q; want 0", code, out, errOut)
	}
	code, out, errOut := kfn(t, "topic", "list", "--json", brokers)
	var topics []topicInfo
	if code != 0 || json.Unmarshal([]byte(out), &topics) != nil {
		t.Fatalf("topic list: exit %d, %q %q", code, out, errOut)
	}
	found := false
	for _, ti := range topics {
		found = found || (ti.Topic == topic && len(ti.Partitions) == 3)
	}
	if !found {
		t.Errorf("topic list does not show %s with 3 partitions: %s", topic, out)
	}
	k.Produce(t, topic, kafka.Message{Partition: 1, Value: []byte("x")}, kafka.Message{Partition: 1, Value: []byte("y")})
	code, out, errOut = kfn(t, "topic", "describe", topic, "--json", brokers)
	var info topicInfo
	if code != 0 || json.Unmarshal([]byte(out), &info) != nil || len(info.Partitions) != 3 || info.Partitions[1].High != 2 || info.Partitions[0].High != 0 {
		t.Errorf("topic describe: exit %d, %q %q; want 3 partitions, partition 1 at high watermark 2", code, out, errOut)
	}
	if code, _, errOut := kfn(t, "topic", "describe", "no-such-topic-"+topic, brokers); code != 1 || !strings.Contains(errOut, "kfn topic create") {
		t.Errorf("describe of a missing topic: exit %d, %q; want 1 with a hint", code, errOut)
	}
	for _, args := range [][]string{{"topic"}, {"topic", "drop", topic, brokers}, {"topic", "create", brokers}, {"topic", "create", "a", "b", brokers}, {"topic", "create", topic, "--partitions", "0", brokers}, {"topic", "list"}} {
		if code, _, _ := kfn(t, args...); code != 2 {
			t.Errorf("kfn %v: exit %d, want 2 (usage)", args, code)
		}
	}
}

// TestProduceSendsWhatTheLinesSay: every kind of line lands as written —
// text and binary keys, JSON and text values, headers, tombstones, an
// explicit partition — and keyed records land where murmur2 puts them, so
// the same key always goes to the same partition.
func TestProduceSendsWhatTheLinesSay(t *testing.T) {
	k := kfntest.Kafka(t)
	brokers := "--kafka-brokers=" + strings.Join(k.Brokers, ",")
	topic := k.CreateTopic(t, 1)
	binKey := []byte{0, 0, 0, 0, 7, 0xff}
	lines := []string{
		`{"key": "ord-1", "value": {"order_id": "ord-1", "amount_cents": 5}, "headers": {"source": "test", "traceparent": "00-x"}}`,
		`{"key_base64": "` + base64.StdEncoding.EncodeToString(binKey) + `", "value": "plain text"}`,
		`{"key": "ord-2", "value": null}`,
		`{"value_base64": "` + base64.StdEncoding.EncodeToString([]byte{1, 2, 0, 3}) + `", "partition": 0}`,
	}
	file := filepath.Join(t.TempDir(), "records.jsonl")
	if err := os.WriteFile(file, []byte(strings.Join(lines, "\n")+"\n\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := kfn(t, "produce", topic, "--file", file, "--json", brokers)
	if code != 0 || strings.Count(out, "\n") != 4 {
		t.Fatalf("produce: exit %d, %q %q", code, out, errOut)
	}
	got := readAll(t, k.Brokers, topic, 0, 4)
	want := []struct {
		key, value string
		headers    int
	}{
		{"ord-1", `{"order_id": "ord-1", "amount_cents": 5}`, 2},
		{string(binKey), "plain text", 0},
		{"ord-2", "", 0},
		{"", string([]byte{1, 2, 0, 3}), 0},
	}
	for i, w := range want {
		m := got[i]
		if string(m.Key) != w.key || string(m.Value) != w.value || len(m.Headers) != w.headers {
			t.Errorf("record %d = key %q value %q %d headers; want %q %q %d", i, m.Key, m.Value, len(m.Headers), w.key, w.value, w.headers)
		}
	}
	if got[2].Value != nil {
		t.Errorf("a null value arrived as %q, want a tombstone", got[2].Value)
	}

	// One record from flags, and murmur2 placement on several partitions.
	multi := k.CreateTopic(t, 4)
	var first string
	for i := 0; i < 3; i++ {
		code, out, errOut := kfn(t, "produce", multi, "--key", "same-key", "--value", fmt.Sprint(i), "--header", "a=b", brokers)
		if code != 0 {
			t.Fatalf("produce from flags: exit %d %q", code, errOut)
		}
		line := strings.Split(out, "\n")[2] // the table row
		if first == "" {
			first = strings.Fields(line)[0]
		} else if p := strings.Fields(line)[0]; p != first {
			t.Errorf("the same key went to partitions %s and %s", first, p)
		}
	}
	if want := fmt.Sprint((&kafka.Murmur2Balancer{}).Balance(kafka.Message{Key: []byte("same-key")}, 0, 1, 2, 3)); first != want {
		t.Errorf("key placed on partition %s, want %s (murmur2, as Kafka's Java client)", first, want)
	}

	// Bad input is a usage error naming the line; nothing is sent.
	bad := filepath.Join(t.TempDir(), "bad.jsonl")
	os.WriteFile(bad, []byte(lines[0]+"\n{\"key\": 1}\n"), 0o600) //nolint:errcheck
	before := k.HighWatermarks(t, topic)[0]
	if code, _, errOut := kfn(t, "produce", topic, "--file", bad, brokers); code != 2 || !strings.Contains(errOut, "line 2") {
		t.Errorf("bad line: exit %d, %q; want 2 naming line 2", code, errOut)
	}
	if after := k.HighWatermarks(t, topic)[0]; after != before {
		t.Errorf("a file with a bad line sent %d records, want none", after-before)
	}
	if code, _, errOut := kfn(t, "produce", "no-such-"+topic, "--value", "x", brokers); code != 1 || !strings.Contains(errOut, "kfn topic create") {
		t.Errorf("unknown topic: exit %d, %q; want 1 with the hint", code, errOut)
	}
}

// TestTailPrintsEvents publishes two events as the relay does and reads
// them back with kfn tail: ids, keys (text and binary) and data.
func TestTailPrintsEvents(t *testing.T) {
	url := kfntest.NATSURL(t)
	js := jetStreamAt(t, url)
	stream := strings.ToUpper(strings.ReplaceAll(kfntest.Name(t, "tail"), "-", "_"))
	subject := strings.ToLower(stream) + ".captured"
	ctx := context.Background()
	if _, err := outbox.ExtendStream(ctx, js, stream, []string{subject}, outbox.StreamLimits{Duplicates: time.Minute, MaxAge: time.Hour}); err != nil {
		t.Fatal(err)
	}
	publish := func(id string, h map[string]string, data []byte) {
		m := nats.NewMsg(subject)
		m.Header.Set(outbox.HeaderID, id)
		for k, v := range h {
			m.Header.Set(k, v)
		}
		m.Data = data
		if _, err := js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	publish("ev-1", map[string]string{outbox.HeaderKey: "ord-1", outbox.HeaderType: "captured"}, []byte(`{"a":1}`))
	publish("ev-2", map[string]string{outbox.HeaderKeyBase64: base64.StdEncoding.EncodeToString([]byte{0, 1})}, []byte{0xff, 0})

	code, out, errOut := kfn(t, "tail", subject, "--all", "--count", "2", "--json", "--nats-url", url, "--event-stream", stream)
	if code != 0 {
		t.Fatalf("tail: exit %d, %q %q", code, out, errOut)
	}
	var evs []tailedEvent
	dec := json.NewDecoder(strings.NewReader(out))
	for dec.More() {
		var ev tailedEvent
		if err := dec.Decode(&ev); err != nil {
			t.Fatal(err)
		}
		evs = append(evs, ev)
	}
	if len(evs) != 2 || evs[0].ID != "ev-1" || evs[0].Key != "ord-1" || evs[0].Data != `{"a":1}` || evs[0].Type != "captured" ||
		evs[1].ID != "ev-2" || evs[1].KeyBase64 != "AAE=" || evs[1].DataBase64 != base64.StdEncoding.EncodeToString([]byte{0xff, 0}) {
		t.Errorf("tail printed %+v", evs)
	}
	if code, _, _ := kfn(t, "tail", "bad subject", "--nats-url", url); code != 2 {
		t.Errorf("a bad subject: exit %d, want 2", code)
	}
	if code, _, errOut := kfn(t, "tail", subject, "--count", "1", "--nats-url", url, "--event-stream", "NO_SUCH_STREAM"); code != 1 || !strings.Contains(errOut, "does not exist") {
		t.Errorf("a missing stream: exit %d, %q", code, errOut)
	}
}
