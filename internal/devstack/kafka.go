package devstack

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

// KafkaOptions configures StartKafka. The zero value is a one-broker,
// in-memory cluster on a free port that creates topics only through the
// CreateTopics API.
type KafkaOptions struct {
	// Port to listen on at 127.0.0.1; 0 picks a free one.
	Port int
	// AutoCreateTopics lets a Metadata request that asks for it create a
	// missing topic (what Apache Kafka calls auto.create.topics.enable).
	AutoCreateTopics bool
	// DefaultPartitions is the partition count of auto-created topics and of
	// CreateTopics requests that ask for -1 partitions; default 1.
	DefaultPartitions int
	// DataDir keeps the cluster's topics, records and committed offsets on
	// disk so that Restart finds them again. Empty means in memory only.
	DataDir string
	// Logger receives the broker's own log: its warnings and errors at their
	// level, its per-request chatter at Debug. Nil discards it.
	Logger *slog.Logger
}

// Kafka is a running in-process Kafka-protocol broker (franz-go's kfake).
// It speaks the Kafka wire protocol on 127.0.0.1, so kafka-go, franz-go and
// librdkafka clients use it like a real one-broker cluster.
//
// Differences from Apache Kafka that client code must tolerate (checked with
// kafka-go v0.4.51 against Kafka 4.4):
//   - OffsetFetch for a group that never committed fails the whole group with
//     GROUP_ID_NOT_FOUND; Kafka answers offset -1 per partition, no error.
//   - Topics are created and deleted at once; on Kafka, partitions get their
//     leaders a little after CreateTopics returns and DeleteTopics finishes
//     in the background.
//   - There is no coordinator start-up: Kafka can answer NOT_COORDINATOR to
//     the first group requests on a fresh broker, so retry those.
type Kafka struct {
	// Brokers are the bootstrap addresses ("127.0.0.1:PORT").
	Brokers []string

	opts    KafkaOptions
	port    int
	mu      sync.Mutex
	cluster *kfake.Cluster
}

// StartKafka starts an in-process one-broker Kafka cluster.
func StartKafka(opts KafkaOptions) (*Kafka, error) {
	if opts.DefaultPartitions <= 0 {
		opts.DefaultPartitions = 1
	}
	k := &Kafka{opts: opts, port: opts.Port}
	if err := k.start(); err != nil {
		return nil, fmt.Errorf("start in-process kafka: %w", err)
	}
	return k, nil
}

func (k *Kafka) start() error {
	started := time.Now()
	kopts := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.Ports(k.port),
		kfake.ClusterID("kfn-dev"),
		kfake.DefaultNumPartitions(k.opts.DefaultPartitions),
	}
	if k.opts.AutoCreateTopics {
		kopts = append(kopts, kfake.AllowAutoTopicCreation())
	}
	if k.opts.DataDir != "" {
		kopts = append(kopts, kfake.DataDir(k.opts.DataDir))
	}
	if k.opts.Logger != nil {
		kopts = append(kopts, kfake.WithLogger(kfakeLogger{k.opts.Logger}))
	}
	c, err := kfake.NewCluster(kopts...)
	if err != nil {
		if k.port != 0 {
			return fmt.Errorf("listen on 127.0.0.1:%d: %w", k.port, err)
		}
		return err
	}
	addrs := c.ListenAddrs()
	if len(addrs) != 1 {
		c.Close()
		return fmt.Errorf("kfake listens on %v, want exactly one broker", addrs)
	}
	_, portStr, err := net.SplitHostPort(addrs[0])
	if err != nil {
		c.Close()
		return fmt.Errorf("kfake listen address %q: %w", addrs[0], err)
	}
	k.port, _ = strconv.Atoi(portStr)
	k.mu.Lock()
	k.cluster = c
	k.Brokers = addrs
	k.mu.Unlock()
	if k.opts.Logger != nil {
		k.opts.Logger.Info("in-process kafka started", "brokers", addrs, "took", time.Since(started))
	}
	return nil
}

// Cluster is the underlying kfake cluster, for tests that inject faults
// through its Control hooks. It changes on Restart.
func (k *Kafka) Cluster() *kfake.Cluster {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.cluster
}

// Stop shuts the broker down; connected clients see their connections close.
// With a DataDir, the state is flushed to disk first. Safe to call twice.
func (k *Kafka) Stop() {
	k.mu.Lock()
	c := k.cluster
	k.cluster = nil
	k.mu.Unlock()
	if c != nil {
		c.Close()
	}
}

// Start starts a stopped broker again on the same port, with the state it
// kept in KafkaOptions.DataDir (an error without one). It returns an error
// if the broker is running.
func (k *Kafka) Start() error {
	if k.opts.DataDir == "" {
		return fmt.Errorf("start in-process kafka again: KafkaOptions.DataDir is empty, so every topic is gone; set DataDir")
	}
	if k.Cluster() != nil {
		return fmt.Errorf("start in-process kafka on port %d: it is running", k.port)
	}
	if err := k.start(); err != nil {
		return fmt.Errorf("start in-process kafka again on port %d: %w", k.port, err)
	}
	return nil
}

// Restart stops the broker and starts it again on the same port. Topics,
// records and committed offsets survive only when KafkaOptions.DataDir is
// set; without it Restart returns an error instead of silently losing them.
func (k *Kafka) Restart() error {
	if k.opts.DataDir == "" {
		return fmt.Errorf("restart in-process kafka: KafkaOptions.DataDir is empty, so a restart would lose every topic; set DataDir")
	}
	k.Stop()
	if err := k.start(); err != nil {
		return fmt.Errorf("restart in-process kafka on port %d: %w", k.port, err)
	}
	return nil
}

// kfakeLogger forwards kfake's log to slog. kfake logs every request at Info,
// which is Debug material for us.
type kfakeLogger struct{ log *slog.Logger }

func (l kfakeLogger) Logf(level kfake.LogLevel, format string, args ...any) {
	var lvl slog.Level
	switch level {
	case kfake.LogLevelError:
		lvl = slog.LevelError
	case kfake.LogLevelWarn:
		lvl = slog.LevelWarn
	default:
		lvl = slog.LevelDebug
	}
	if !l.log.Enabled(context.Background(), lvl) {
		return
	}
	l.log.Log(context.Background(), lvl, fmt.Sprintf(format, args...), "component", "kfake")
}
