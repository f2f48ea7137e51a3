package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/kafkasource"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/runtime"
)

// topicCommands are the subcommands of kfn topic.
var topicCommands = map[string]command{
	"create":   {"create a topic", runTopicCreate},
	"list":     {"list the topics and their partition counts", runTopicList},
	"describe": {"show a topic's partitions: leader, replicas, first offset, high watermark", runTopicDescribe},
}

var topicHelp = help{
	usage: []string{
		"kfn topic create NAME [--partitions N] [--replication-factor R] [--if-not-exists]",
		"kfn topic list [--json]",
		"kfn topic describe NAME [--json]",
	},
	text: `
Creates, lists and describes Kafka topics, on the kfn dev stack or a real
cluster (--kafka-brokers / KFN_KAFKA_BROKERS). A function waits for its
topic to exist; create it first. Run kfn topic <command> -h for a command's
flags.`,
	commands: topicCommands,
	examples: `
kfn topic create payments --partitions 4
kfn topic describe payments
kfn topic list --json      # with the export lines kfn dev prints, in another terminal`,
}

func runTopic(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return &usageError{msg: "missing subcommand: create, list or describe"}
	}
	if args[0] == "-h" || args[0] == "--help" {
		return &helpRequest{help: topicHelp}
	}
	if strings.HasPrefix(args[0], "-") {
		return &usageError{msg: fmt.Sprintf("unknown flag %s: give the subcommand first: create, list or describe", args[0])}
	}
	sub, ok := topicCommands[args[0]]
	if !ok {
		return &usageError{msg: fmt.Sprintf("unknown subcommand %q: use create, list or describe", args[0])}
	}
	return inCommand("topic "+args[0], sub.run(ctx, args[1:], stdout, stderr))
}

// topicFlags makes the flag set of kfn topic NAME, whose -h prints h, with
// the Kafka settings every topic command takes.
func topicFlags(name string, h help, stderr io.Writer) (*flagSet, *[]string, *runtime.KafkaSecurity) {
	fs := newFlags("topic "+name, h, stderr)
	return fs, bind(fs, settings.KafkaBrokers), bindKafkaSecurity(fs)
}

// kafkaClient returns a Kafka client with a transport of its own (kafka-go's
// default one caches metadata across clients, and would not know a topic
// created after its last refresh), and a function that closes it. It
// connects with sec's TLS and SASL; a problem of those settings is an error.
func kafkaClient(brokers []string, sec runtime.KafkaSecurity) (*kafka.Client, func(), error) {
	return kafkaconn.Client(brokers, sec)
}

func runTopicCreate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, brokers, sec := topicFlags("create", help{
		usage: []string{"kfn topic create NAME [--partitions N] [--replication-factor R] [--if-not-exists]"},
		text: `
Creates Kafka topic NAME. A function waits for its topic to exist; create
it first.`,
		examples: `
kfn topic create payments --partitions 4
kfn topic create payments --partitions 12 --replication-factor 3 --if-not-exists`,
	}, stderr)
	partitions := fs.Int("partitions", 1, "partitions of the new topic")
	replication := fs.Int("replication-factor", 1, "replicas of each partition (at most the number of brokers)")
	ifMissing := fs.Bool("if-not-exists", false, "succeed when the topic exists already (for init steps)")
	pos, err := parsePositional(fs, args, 1, 1, "the topic's name")
	if err != nil {
		return err
	}
	if *partitions < 1 || *replication < 1 {
		return &usageError{msg: "--partitions and --replication-factor must be at least 1"}
	}
	if err := requireBrokers(*brokers); err != nil {
		return err
	}
	topic := pos[0]
	client, closeClient, err := kafkaClient(*brokers, *sec)
	if err != nil {
		return err
	}
	defer closeClient()
	resp, err := client.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{
		Topic: topic, NumPartitions: *partitions, ReplicationFactor: *replication,
	}}})
	if err != nil {
		return fmt.Errorf("create topic %s on %v: %w", topic, *brokers, kafkaconn.Explain(err, *brokers, *sec))
	}
	if err := resp.Errors[topic]; err != nil {
		if errors.Is(err, kafka.TopicAlreadyExists) {
			if *ifMissing {
				fmt.Fprintf(stdout, "topic %s exists already\n", topic)
				return nil
			}
			return fmt.Errorf("topic %s already exists (kfn topic describe %s shows it; --if-not-exists accepts it)", topic, topic)
		}
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	if err := ensureTopic(ctx, *brokers, *sec, topic, *partitions); err != nil { // waits for the partitions' leaders
		return err
	}
	fmt.Fprintf(stdout, "created topic %s with %d partitions (replication factor %d)\n", topic, *partitions, *replication)
	return nil
}

// topicInfo is what list and describe print for a topic.
type topicInfo struct {
	Topic      string          `json:"topic"`
	Partitions []partitionInfo `json:"partitions"`
}

type partitionInfo struct {
	Partition int    `json:"partition"`
	Leader    string `json:"leader"`
	Replicas  int    `json:"replicas"`
	First     int64  `json:"first_offset"`
	High      int64  `json:"high_watermark"`
}

func readTopics(ctx context.Context, brokers []string, sec runtime.KafkaSecurity, names []string, offsets bool) ([]topicInfo, error) {
	client, closeClient, err := kafkaClient(brokers, sec)
	if err != nil {
		return nil, err
	}
	defer closeClient()
	md, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: names})
	if err != nil {
		return nil, fmt.Errorf("read topics from %v: %w", brokers, kafkaconn.Explain(err, brokers, sec))
	}
	var out []topicInfo
	for _, t := range md.Topics {
		if t.Error != nil {
			if errors.Is(t.Error, kafka.UnknownTopicOrPartition) {
				return nil, fmt.Errorf("topic %s does not exist (kfn topic create %s)", t.Name, t.Name)
			}
			return nil, fmt.Errorf("topic %s: %w", t.Name, t.Error)
		}
		if t.Internal {
			continue
		}
		info := topicInfo{Topic: t.Name}
		for _, p := range t.Partitions {
			pi := partitionInfo{Partition: p.ID, Leader: fmt.Sprintf("%s:%d", p.Leader.Host, p.Leader.Port), Replicas: len(p.Replicas), First: -1, High: -1}
			if offsets {
				if pi.First, pi.High, err = kafkasource.OffsetRange(ctx, brokers, sec, t.Name, int32(p.ID)); err != nil {
					return nil, err
				}
			}
			info.Partitions = append(info.Partitions, pi)
		}
		sort.Slice(info.Partitions, func(i, j int) bool { return info.Partitions[i].Partition < info.Partitions[j].Partition })
		out = append(out, info)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Topic < out[j].Topic })
	return out, nil
}

func runTopicList(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, brokers, sec := topicFlags("list", help{
		usage: []string{"kfn topic list [--json]"},
		text: `
Lists the topics of the Kafka cluster, each with its number of partitions.`,
		examples: `
kfn topic list
kfn topic list --json      # with the export lines kfn dev prints, in another terminal`,
	}, stderr)
	asJSON := fs.Bool("json", false, "print JSON for scripts")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := requireBrokers(*brokers); err != nil {
		return err
	}
	topics, err := readTopics(ctx, *brokers, *sec, nil, false)
	if err != nil {
		return err
	}
	if *asJSON {
		return writeJSON(stdout, topics)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TOPIC\tPARTITIONS")
	for _, t := range topics {
		fmt.Fprintf(tw, "%s\t%d\n", t.Topic, len(t.Partitions))
	}
	return tw.Flush()
}

func runTopicDescribe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, brokers, sec := topicFlags("describe", help{
		usage: []string{"kfn topic describe NAME [--json]"},
		text: `
Shows each partition of topic NAME: its leader, its number of replicas, its
first offset and its high watermark.`,
		examples: `
kfn topic describe payments
kfn topic describe payments --json | jq '.partitions[].high_watermark'`,
	}, stderr)
	asJSON := fs.Bool("json", false, "print JSON for scripts")
	pos, err := parsePositional(fs, args, 1, 1, "the topic's name")
	if err != nil {
		return err
	}
	if err := requireBrokers(*brokers); err != nil {
		return err
	}
	topics, err := readTopics(ctx, *brokers, *sec, pos, true)
	if err != nil {
		return err
	}
	if *asJSON {
		return writeJSON(stdout, topics[0])
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PARTITION\tLEADER\tREPLICAS\tFIRST\tHIGH WATERMARK")
	for _, p := range topics[0].Partitions {
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%d\n", p.Partition, p.Leader, p.Replicas, p.First, p.High)
	}
	return tw.Flush()
}

// requireBrokers says that the command needs Kafka's address.
func requireBrokers(brokers []string) error {
	if len(brokers) == 0 {
		return &usageError{msg: fmt.Sprintf("--%s is required (or set %s; kfn dev prints it)", settings.KafkaBrokers.Flag, settings.KafkaBrokers.Env)}
	}
	return nil
}
