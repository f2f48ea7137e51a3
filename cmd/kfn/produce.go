package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/runtime"
)

var produceHelp = help{
	usage: []string{
		"kfn produce TOPIC [--key K] [--value V] [--header NAME=VALUE]...",
		"kfn produce TOPIC --file FILE|-  [--rate N]",
	},
	text: `
Sends records to a Kafka topic and reports where they landed: one record
from the flags, or one per JSON line of a file ("-" reads stdin):

  {"key": "ord-1", "value": {"order_id": "ord-1"}, "headers": {"source": "test"}}

"value" may be a JSON string (sent as its text) or any other JSON value (sent
as its JSON encoding); "key_base64"/"value_base64" carry bytes that are not
text; "partition" picks a partition, else records with a key go to the
partition Kafka's Java client would pick (murmur2 of the key) and records
without one go round-robin. A null or missing value is a tombstone.`,
	examples: `
kfn produce payments --key p-1 --value '{"amount_cents": 500}'
kfn produce payments --file payments.jsonl --rate 20
echo '{"key":"a","value":"x"}' | kfn produce payments --file - --json`,
}

// produceLine is one JSON line of kfn produce --file.
type produceLine struct {
	Key         *string           `json:"key"`
	KeyBase64   *string           `json:"key_base64"`
	Value       json.RawMessage   `json:"value"`
	ValueBase64 *string           `json:"value_base64"`
	Headers     map[string]string `json:"headers"`
	Partition   *int              `json:"partition"`
}

// produced is where a record landed.
type produced struct {
	Partition int    `json:"partition"`
	Offset    int64  `json:"offset"`
	Key       string `json:"key,omitempty"`
}

func runProduce(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("produce", produceHelp, stderr)
	brokers := bind(fs, settings.KafkaBrokers)
	sec := bindKafkaSecurity(fs)
	key := fs.String("key", "", "the record's key (none when empty)")
	value := fs.String("value", "", "the record's value")
	var headers headerFlags
	fs.Var(&headers, "header", "a header NAME=VALUE (repeatable)")
	partition := fs.Int("partition", -1, "send to this partition (default: by key, murmur2 like Kafka's Java client; round-robin without a key)")
	file := fs.String("file", "", `JSON lines to send, one record each ("-": stdin)`)
	rate := fs.Float64("rate", 0, "records per second (0: as fast as Kafka takes them)")
	asJSON := fs.Bool("json", false, "print one JSON line per record instead of a summary")
	pos, err := parsePositional(fs, args, 1, 1, "the topic")
	if err != nil {
		return err
	}
	if err := requireBrokers(*brokers); err != nil {
		return err
	}
	if *rate < 0 {
		return &usageError{msg: "--rate must not be negative"}
	}
	var msgs []kafka.Message
	if *file != "" {
		if given(fs, "key") || given(fs, "value") || given(fs, "partition") || len(headers) > 0 {
			return &usageError{msg: "--file takes the keys, values, headers and partitions from its lines: drop --key, --value, --partition and --header"}
		}
		if msgs, err = readProduceFile(*file, os.Stdin); err != nil {
			return err
		}
	} else {
		m := kafka.Message{Value: []byte(*value), Headers: headers, Partition: *partition}
		if *key != "" {
			m.Key = []byte(*key)
		}
		msgs = []kafka.Message{m}
	}
	res, err := produceRecords(ctx, *brokers, *sec, pos[0], msgs, *rate, func(p produced) {
		if *asJSON {
			json.NewEncoder(stdout).Encode(p) //nolint:errcheck // stdout
		}
	})
	if err != nil {
		return err
	}
	if !*asJSON {
		printProduced(stdout, pos[0], res)
	}
	return nil
}

// headerFlags collects --header NAME=VALUE.
type headerFlags []kafka.Header

func (h *headerFlags) String() string { return "" }

func (h *headerFlags) Set(s string) error {
	name, value, ok := strings.Cut(s, "=")
	if !ok || name == "" {
		return fmt.Errorf("%q is not NAME=VALUE", s)
	}
	*h = append(*h, kafka.Header{Key: name, Value: []byte(value)})
	return nil
}

// readProduceFile reads JSON lines into records; "-" is stdin.
func readProduceFile(name string, stdin io.Reader) ([]kafka.Message, error) {
	r := stdin
	if name != "-" {
		f, err := os.Open(name)
		if err != nil {
			return nil, &usageError{msg: fmt.Sprintf("--file: %v", err)}
		}
		defer f.Close()
		r = f
	}
	var msgs []kafka.Message
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for n := 1; sc.Scan(); n++ {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		m, err := parseProduceLine(line)
		if err != nil {
			return nil, &usageError{msg: fmt.Sprintf("%s line %d: %v", name, n, err)}
		}
		msgs = append(msgs, m)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	if len(msgs) == 0 {
		return nil, &usageError{msg: fmt.Sprintf("%s holds no records", name)}
	}
	return msgs, nil
}

func parseProduceLine(line []byte) (kafka.Message, error) {
	var l produceLine
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&l); err != nil {
		return kafka.Message{}, fmt.Errorf("not a record: %v (want {\"key\": …, \"value\": …, \"headers\": {…}})", err)
	}
	var m kafka.Message
	switch {
	case l.Key != nil && l.KeyBase64 != nil:
		return m, errors.New(`give "key" or "key_base64", not both`)
	case l.Key != nil:
		m.Key = []byte(*l.Key)
	case l.KeyBase64 != nil:
		k, err := base64.StdEncoding.DecodeString(*l.KeyBase64)
		if err != nil {
			return m, fmt.Errorf("key_base64: %v", err)
		}
		m.Key = k
	}
	switch v := bytes.TrimSpace(l.Value); {
	case len(v) > 0 && l.ValueBase64 != nil:
		return m, errors.New(`give "value" or "value_base64", not both`)
	case l.ValueBase64 != nil:
		b, err := base64.StdEncoding.DecodeString(*l.ValueBase64)
		if err != nil {
			return m, fmt.Errorf("value_base64: %v", err)
		}
		m.Value = b
	case len(v) == 0 || string(v) == "null":
		// a tombstone
	case v[0] == '"':
		var s string
		if err := json.Unmarshal(v, &s); err != nil {
			return m, fmt.Errorf("value: %v", err)
		}
		m.Value = []byte(s)
	default:
		m.Value = append([]byte(nil), v...)
	}
	names := make([]string, 0, len(l.Headers))
	for k := range l.Headers {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		m.Headers = append(m.Headers, kafka.Header{Key: k, Value: []byte(l.Headers[k])})
	}
	if l.Partition != nil {
		if *l.Partition < 0 {
			return m, fmt.Errorf("partition %d is negative", *l.Partition)
		}
		m.Partition = *l.Partition
	} else {
		m.Partition = -1
	}
	return m, nil
}

// produceRecords sends msgs to topic in order, rate a second (0: at once),
// and calls landed for each record with where it landed. A message's
// Partition of -1 lets the key decide.
func produceRecords(ctx context.Context, brokers []string, sec runtime.KafkaSecurity, topic string, msgs []kafka.Message, rate float64, landed func(produced)) ([]produced, error) {
	client, closeClient, err := kafkaClient(brokers, sec)
	if err != nil {
		return nil, err
	}
	defer closeClient()
	md, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return nil, fmt.Errorf("read topic %s from %v: %w", topic, brokers, kafkaconn.Explain(err, brokers, sec))
	}
	if len(md.Topics) != 1 || md.Topics[0].Error != nil {
		if len(md.Topics) == 1 && errors.Is(md.Topics[0].Error, kafka.UnknownTopicOrPartition) {
			return nil, fmt.Errorf("topic %s does not exist: create it with kfn topic create %s --partitions N", topic, topic)
		}
		return nil, fmt.Errorf("topic %s: %v", topic, md.Topics)
	}
	partitions := len(md.Topics[0].Partitions)
	balancer := &kafka.Murmur2Balancer{}
	roundRobin := 0
	ids := make([]int, partitions)
	for i := range ids {
		ids[i] = i
	}
	var pace *pacer
	if rate > 0 {
		pace = newPacer(rate, time.Now())
	}
	out := make([]produced, 0, len(msgs))
	for len(msgs) > 0 {
		n := len(msgs)
		if pace != nil {
			if n = min(n, pace.due(time.Now())); n == 0 {
				select {
				case <-ctx.Done():
					return out, ctx.Err()
				case <-time.After(pace.tick()):
				}
				continue
			}
		}
		for _, m := range msgs[:n] {
			p := m.Partition
			switch {
			case p >= partitions:
				return out, &usageError{msg: fmt.Sprintf("partition %d: topic %s has %d partitions", p, topic, partitions)}
			case p >= 0:
			case m.Key != nil:
				p = balancer.Balance(m, ids...)
			default:
				p, roundRobin = roundRobin%partitions, roundRobin+1
			}
			res, err := client.Produce(ctx, &kafka.ProduceRequest{
				Topic: topic, Partition: p, RequiredAcks: kafka.RequireAll,
				Records: kafka.NewRecordReader(kafka.Record{Key: bytesOrNil(m.Key), Value: bytesOrNil(m.Value), Headers: m.Headers, Time: time.Now()}),
			})
			if err == nil && res.Error != nil {
				err = res.Error
			}
			if err != nil {
				return out, fmt.Errorf("produce to %s/%d: %w (%d records sent before)", topic, p, err, len(out))
			}
			r := produced{Partition: p, Offset: res.BaseOffset, Key: string(m.Key)}
			out = append(out, r)
			landed(r)
		}
		msgs = msgs[n:]
	}
	return out, nil
}

func bytesOrNil(b []byte) kafka.Bytes {
	if b == nil {
		return nil
	}
	return kafka.NewBytes(b)
}

// printProduced summarises where records landed, per partition.
func printProduced(w io.Writer, topic string, res []produced) {
	type span struct{ first, last, n int64 }
	spans := map[int]*span{}
	for _, r := range res {
		s := spans[r.Partition]
		if s == nil {
			s = &span{first: r.Offset}
			spans[r.Partition] = s
		}
		s.last, s.n = r.Offset, s.n+1
	}
	parts := make([]int, 0, len(spans))
	for p := range spans {
		parts = append(parts, p)
	}
	sort.Ints(parts)
	fmt.Fprintf(w, "sent %d records to %s\n", len(res), topic)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PARTITION\tRECORDS\tOFFSETS")
	for _, p := range parts {
		s := spans[p]
		fmt.Fprintf(tw, "%d\t%d\t%d..%d\n", p, s.n, s.first, s.last)
	}
	tw.Flush() //nolint:errcheck // stdout
}
