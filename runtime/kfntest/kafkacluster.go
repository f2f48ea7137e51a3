package kfntest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/devstack"
)

// envKafkaStartTimeout is kafka.sh's bound, in seconds, on how long a node
// may take to answer; the harness keeps to it too (default 120: a JVM
// starts slowly on a busy 2-core machine).
const envKafkaStartTimeout = "KFN_KAFKA_START_TIMEOUT"

// kafkaNodeStartTimeout reads envKafkaStartTimeout.
func kafkaNodeStartTimeout() (time.Duration, error) {
	v := os.Getenv(envKafkaStartTimeout)
	if v == "" {
		return 120 * time.Second, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("%s=%q: want a whole number of seconds above 0", envKafkaStartTimeout, v)
	}
	return time.Duration(n) * time.Second, nil
}

// clusterReplicas is the replication factor of a KafkaProcessCluster's
// topics; kafka.sh's cluster mode sets min.insync.replicas to 2.
const clusterReplicas = 3

// KafkaProcessCluster is a real Apache Kafka cluster of n KRaft nodes, each
// a JVM process of its own (a broker and a controller, with a static
// controller quorum), started by deploy/local/kafka/kafka.sh in cluster
// mode: replication factor 3, min.insync.replicas 2. Fault tests kill and
// start its brokers; node id i (1..n) is broker id i.
type KafkaProcessCluster struct {
	t            testing.TB
	script       string
	startTimeout time.Duration // how long a node may take to answer
	env          []string
	brokers      []string
	kafka        *KafkaCluster

	mu    sync.Mutex
	procs []*Process // by node id - 1; nil before the first start
}

// HaveJava reports whether a KafkaProcessCluster can start here: java
// (JAVA_HOME's, else the one on PATH) and mvn are installed.
func HaveJava() bool { return missingJava() == "" }

// missingJava names what a KafkaProcessCluster lacks here, or returns "".
func missingJava() string {
	var missing []string
	java := "java"
	if home := os.Getenv("JAVA_HOME"); home != "" {
		java = filepath.Join(home, "bin", "java")
	}
	if _, err := exec.LookPath(java); err != nil {
		missing = append(missing, java+" (Java 17+)")
	}
	if _, err := exec.LookPath("mvn"); err != nil {
		missing = append(missing, "mvn (Maven, which fetches the Kafka jars)")
	}
	return strings.Join(missing, " and ")
}

// KafkaClusterProcesses starts n (at least 3) Apache Kafka nodes on free
// ports with their data under t.TempDir(), waits until every one answers
// and lists all n brokers, and kills them all when the test ends, failed or
// not. Each node runs as `kafka.sh run N`, a child process of the test
// binary, so it also dies with the test binary. A node may take
// KFN_KAFKA_START_TIMEOUT seconds (default 120) to answer, here and in
// Start. It fails the test at once when Java or Maven is missing (check
// HaveJava to choose another broker).
func KafkaClusterProcesses(t testing.TB, n int) *KafkaProcessCluster {
	t.Helper()
	if n < clusterReplicas {
		t.Fatalf("kfntest: KafkaClusterProcesses: n = %d, want at least %d (the topics' replication factor)", n, clusterReplicas)
	}
	if missing := missingJava(); missing != "" {
		t.Fatalf("kfntest: a real Kafka cluster needs %s on PATH (Debian: apt-get install -y openjdk-17-jre-headless maven)", missing)
	}
	script, err := kafkaScript()
	if err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	startTimeout, err := kafkaNodeStartTimeout()
	if err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	ports, err := freePorts(2 * n)
	if err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	c := &KafkaProcessCluster{t: t, script: script, startTimeout: startTimeout, procs: make([]*Process, n)}
	var cports []string
	for i := range n {
		c.brokers = append(c.brokers, net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[i])))
		cports = append(cports, strconv.Itoa(ports[n+i]))
	}
	for _, kv := range os.Environ() {
		// One node only: kafka.sh refuses a secure cluster.
		if !strings.HasPrefix(kv, "KFN_KAFKA_SECURE=") {
			c.env = append(c.env, kv)
		}
	}
	c.env = append(c.env,
		"KFN_KAFKA_NODES="+strconv.Itoa(n),
		"KFN_KAFKA_DATA="+t.TempDir(),
		"KFN_KAFKA_PORTS="+strings.Join(portsOf(c.brokers), ","),
		"KFN_KAFKA_CONTROLLER_PORTS="+strings.Join(cports, ","),
	)
	// Metadata refreshed every second (kafka-go's default is 6 s, and a
	// failed request does not refresh it): Produce and HighWatermarks find
	// a partition's new leader soon after a broker is killed.
	transport := &kafka.Transport{DialTimeout: 5 * time.Second, IdleTimeout: 30 * time.Second, MetadataTTL: time.Second}
	t.Cleanup(transport.CloseIdleConnections)
	c.kafka = &KafkaCluster{
		Brokers: c.brokers, transport: transport, replicas: clusterReplicas, throwaway: true,
		client: &kafka.Client{Addr: kafka.TCP(c.brokers...), Timeout: 10 * time.Second, Transport: transport},
	}

	start := time.Now()
	// The controllers need a quorum: launch every node, then wait.
	for id := 1; id <= n; id++ {
		if err := c.launch(id); err != nil {
			t.Fatalf("kfntest: %v", err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.startTimeout)
	defer cancel()
	for id := 1; id <= n; id++ {
		if err := c.waitReady(ctx, id, n); err != nil {
			t.Fatalf("kfntest: %v", err)
		}
	}
	t.Logf("kfntest: Apache Kafka cluster of %d nodes (KRaft, replication factor %d, min.insync.replicas 2) up in %s: %s",
		n, clusterReplicas, time.Since(start).Round(time.Millisecond), strings.Join(c.brokers, ","))
	return c
}

// kafkaScript finds deploy/local/kafka/kafka.sh in the kfn module this
// package was built from.
func kafkaScript() (string, error) {
	_, file, _, ok := goruntime.Caller(0)
	if !ok {
		return "", errors.New("cannot tell where kfntest's source is, to find deploy/local/kafka/kafka.sh")
	}
	script := filepath.Join(filepath.Dir(file), "..", "..", "deploy", "local", "kafka", "kafka.sh")
	if _, err := os.Stat(script); err != nil {
		return "", fmt.Errorf("find the Kafka start script of the kfn module (built with -trimpath?): %w", err)
	}
	return script, nil
}

// freePorts returns n different free ports.
func freePorts(n int) ([]int, error) {
	var ports []int
	for len(ports) < n {
		p, err := devstack.FreePort()
		if err != nil {
			return nil, err
		}
		if !slices.Contains(ports, p) {
			ports = append(ports, p)
		}
	}
	return ports, nil
}

func portsOf(addrs []string) []string {
	out := make([]string, len(addrs))
	for i, a := range addrs {
		_, out[i], _ = net.SplitHostPort(a)
	}
	return out
}

// Brokers returns every node's host:port, down or not, as a client's
// bootstrap list.
func (c *KafkaProcessCluster) Brokers() []string { return slices.Clone(c.brokers) }

// Cluster is the cluster as the harness's other Kafka helpers see it
// (Produce, HighWatermarks, …); its CreateTopic makes topics with 3
// replicas.
func (c *KafkaProcessCluster) Cluster() *KafkaCluster { return c.kafka }

// CreateTopic creates topic with the given number of partitions and
// replication factor 3 and waits until every partition has a leader. Every
// node must be up.
func (c *KafkaProcessCluster) CreateTopic(t testing.TB, topic string, partitions int) {
	t.Helper()
	c.kafka.CreateTopicNamed(t, topic, partitions)
}

// Kill ends node id (1..n) with SIGKILL: a crash, without a controlled
// shutdown; its partitions get new leaders once the controller quorum
// fences it (broker.session.timeout.ms, 4 s in kafka.sh's cluster mode).
func (c *KafkaProcessCluster) Kill(id int) error {
	p, err := c.node(id)
	if err != nil {
		return err
	}
	if p == nil || exited(p) {
		return fmt.Errorf("kafka node %d is not running", id)
	}
	p.Kill()
	return nil
}

// Start starts node id again, on its port with its data, and returns once
// it answers and the cluster's metadata lists it (the controller has
// unfenced it).
func (c *KafkaProcessCluster) Start(id int) error {
	p, err := c.node(id)
	if err != nil {
		return err
	}
	if p != nil && !exited(p) {
		return fmt.Errorf("kafka node %d is already running", id)
	}
	if err := c.launch(id); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.startTimeout)
	defer cancel()
	return c.waitReady(ctx, id, 0)
}

// Leader returns the id of the node that leads partition of topic, as the
// first node that answers sees it (fresh metadata, no client cache). Right
// after a leader is killed, that is still the dead node until the
// controller fences it.
func (c *KafkaProcessCluster) Leader(ctx context.Context, topic string, partition int) (int, error) {
	parts, err := c.metadata(ctx, topic)
	if err != nil {
		return 0, fmt.Errorf("leader of %s/%d: %w", topic, partition, err)
	}
	for _, p := range parts {
		if p.ID != partition {
			continue
		}
		// kafka-go leaves Leader zero when the leader (-1: none) is not
		// among the listed brokers; node ids start at 1.
		if p.Leader.ID <= 0 || p.Leader.Host == "" {
			return 0, fmt.Errorf("partition %d of %s has no leader", partition, topic)
		}
		return p.Leader.ID, nil
	}
	return 0, fmt.Errorf("no partition %d of %s in the metadata", partition, topic)
}

// InSync reports, as an error, the partitions of topic whose in-sync
// replicas are not all their replicas (a restarted node has not caught up
// yet); nil means every replica of every partition is in sync.
func (c *KafkaProcessCluster) InSync(ctx context.Context, topic string) error {
	parts, err := c.metadata(ctx, topic)
	if err != nil {
		return fmt.Errorf("in-sync replicas of %s: %w", topic, err)
	}
	var behind []string
	for _, p := range parts {
		if len(p.Isr) < len(p.Replicas) {
			behind = append(behind, fmt.Sprintf("partition %d: %d of %d replicas in sync", p.ID, len(p.Isr), len(p.Replicas)))
		}
	}
	if len(behind) > 0 {
		return fmt.Errorf("%s: %s", topic, strings.Join(behind, "; "))
	}
	return nil
}

// metadata reads the partitions of topic from the first node that answers,
// on a connection of its own.
func (c *KafkaProcessCluster) metadata(ctx context.Context, topic string) ([]kafka.Partition, error) {
	var errs []error
	for _, addr := range c.brokers {
		parts, err := partitionsFrom(ctx, addr, topic)
		if err == nil {
			return parts, nil
		}
		errs = append(errs, err)
	}
	return nil, errors.Join(errs...)
}

func partitionsFrom(ctx context.Context, addr, topic string) ([]kafka.Partition, error) {
	conn, err := kafka.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	deadline := time.Now().Add(5 * time.Second)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = conn.SetDeadline(deadline)
	parts, err := conn.ReadPartitions(topic)
	if err != nil {
		return nil, fmt.Errorf("metadata from %s: %w", addr, err)
	}
	return parts, nil
}

func (c *KafkaProcessCluster) node(id int) (*Process, error) {
	if id < 1 || id > len(c.procs) {
		return nil, fmt.Errorf("no kafka node %d: the nodes are 1..%d", id, len(c.procs))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.procs[id-1], nil
}

func exited(p *Process) bool {
	select {
	case <-p.Exited():
		return true
	default:
		return false
	}
}

// launch starts node id's process (`kafka.sh run id`) without waiting.
func (c *KafkaProcessCluster) launch(id int) error {
	cmd := exec.Command("bash", c.script, "run", strconv.Itoa(id))
	cmd.Env = c.env
	p, err := startProcess(c.t, cmd)
	if err != nil {
		return fmt.Errorf("start kafka node %d: %w", id, err)
	}
	// Runs before the process's own cleanup (last in, first out): a SIGKILL
	// at the end of the test, where a SIGTERM would wait for a controlled
	// shutdown that cannot finish once the quorum is gone.
	c.t.Cleanup(p.Kill)
	c.mu.Lock()
	c.procs[id-1] = p
	c.mu.Unlock()
	return nil
}

// waitReady waits until node id answers metadata requests that list
// itself (a fenced broker is not listed) and, with all > 0, all brokers.
// A node that does not become ready is killed.
func (c *KafkaProcessCluster) waitReady(ctx context.Context, id, all int) error {
	p, _ := c.node(id)
	addr := c.brokers[id-1]
	var last error
	for {
		if exited(p) {
			return fmt.Errorf("kafka node %d (%s) exited during startup (%v); output (tail):\n%s", id, addr, p.ExitErr(), p.LogTail(40))
		}
		var listed []int
		if listed, last = brokersListed(ctx, addr); last == nil {
			if !slices.Contains(listed, id) {
				last = fmt.Errorf("its metadata lists brokers %v, not yet itself", listed)
			} else if len(listed) < all {
				last = fmt.Errorf("its metadata lists brokers %v, want all %d", listed, all)
			} else {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			p.Kill()
			return fmt.Errorf("kafka node %d did not become ready on %s within %s (%s): %v; output (tail):\n%s", id, addr, c.startTimeout, envKafkaStartTimeout, last, p.LogTail(40))
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// brokersListed asks the broker at addr for metadata and returns the ids
// of the brokers it lists.
func brokersListed(ctx context.Context, addr string) ([]int, error) {
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	conn, err := kafka.DialContext(dctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
	bs, err := conn.Brokers()
	if err != nil {
		return nil, err
	}
	ids := make([]int, len(bs))
	for i, b := range bs {
		ids[i] = b.ID
	}
	slices.Sort(ids)
	return ids, nil
}
