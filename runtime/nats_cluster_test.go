package runtime_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// electionTimeoutMax is nats-server's longest raft election timeout (9 s
// in 2.15, not configurable): the replicas of a stream whose leader died
// elect a new one 4–9 s later, and the stream takes no writes until then.
const electionTimeoutMax = 9 * time.Second

// On a 3-node NATS cluster with --nats-replicas 3, the server that leads
// the lease bucket's stream is SIGKILLed under load. The bucket's other
// replicas elect a new leader; the workers, whose renewals fail meanwhile,
// stop using their partitions before their leases could pass to anyone,
// take them again once the bucket answers, and go on: every record applied
// exactly once, every event in the (also replicated) stream, no commit
// under a stale token. How long the partitions stood still is printed and
// bounded by the election plus two lease TTLs.
func TestFailoverNATSClusterLosesTheLeaseBucketLeader(t *testing.T) {
	servers := kfntest.NATSClusterProcesses(t, 3)
	c := &cluster{t: t, pg: kfntest.Postgres(t), kafka: kfntest.Kafka(t), natsURL: kfntest.JoinURLs(servers), partitions: failoverPartitions}
	c.topic = c.kafka.CreateTopic(t, failoverPartitions)
	c.fn = kfntest.Name(t, "fn")
	// One worker first, until it owns every partition: it creates the
	// lease bucket (a stream of 3 replicas on a cluster that has just
	// started). A second worker started with it waited for JetStream past
	// its request timeouts under CI load; starting together is what
	// TestWorkersStartingTogetherAllSucceed checks, not this test.
	workers := []*proc{c.startWorkerEnv(c.nextID(), "KFN_NATS_REPLICAS=3")}
	prod := c.startProducer()
	c.waitBalanced(ids(workers), 60*time.Second)
	workers = append(workers, c.startWorkerEnv(c.nextID(), "KFN_NATS_REPLICAS=3"))
	c.waitBalanced(ids(workers), 60*time.Second)

	nc, js, err := connect.NATS(c.natsURL, "test")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	bucketStream := "KV_" + lease.DefaultBucket
	info := streamInfo(t, js, bucketStream)
	for name, si := range map[string]*jetstream.StreamInfo{bucketStream: info, runtime.DefaultStream: streamInfo(t, js, runtime.DefaultStream)} {
		if si.Config.Replicas != 3 || si.Cluster == nil || len(si.Cluster.Replicas) != 2 {
			t.Fatalf("stream %s: %d replicas, cluster %+v; want 3 replicas", name, si.Config.Replicas, si.Cluster)
		}
	}
	leader := info.Cluster.Leader
	i := slices.IndexFunc(servers, func(s *kfntest.NATSServer) bool { return s.Name == leader })
	if i < 0 {
		t.Fatalf("the leader of %s is %q, none of the cluster's servers", bucketStream, leader)
	}
	before := c.cursors()
	servers[i].Kill()
	killed := time.Now()
	t.Logf("SIGKILLed %s, the leader of %s", leader, bucketStream)

	// Every partition gets records all along. Watch the cursors through
	// the election and beyond: a partition stood still for the longest gap
	// between two moves of its cursor (the kill counts as one).
	lastMove, lastNext := map[int]time.Time{}, map[int]int64{}
	for p, cur := range before {
		lastMove[p], lastNext[p] = killed, cur.next
	}
	var stood time.Duration
	stoodPartition := -1
	for watch := electionTimeoutMax + 4*failoverTTL; time.Since(killed) < watch; time.Sleep(50 * time.Millisecond) {
		for p, cur := range c.cursors() {
			if cur.next > lastNext[p] {
				if gap := time.Since(lastMove[p]); gap > stood {
					stood, stoodPartition = gap, p
				}
				lastMove[p], lastNext[p] = time.Now(), cur.next
			}
		}
	}
	for p, at := range lastMove {
		if since := time.Since(at); since > stood {
			stood, stoodPartition = since, p // still standing
		}
	}
	bound := electionTimeoutMax + 2*failoverTTL
	t.Logf("work stood still at most %s (partition %d; lease TTL %s); bound: election timeout %s + 2 × TTL = %s",
		stood.Round(time.Millisecond), stoodPartition, failoverTTL, electionTimeoutMax, bound)
	if newLeader := streamInfo(t, js, bucketStream).Cluster.Leader; newLeader == leader || newLeader == "" {
		t.Errorf("the lease bucket's leader is %q after %s was killed", newLeader, leader)
	} else {
		t.Logf("the new leader of %s is %s", bucketStream, newLeader)
	}
	if stood > bound {
		t.Errorf("a partition stood still %s after the lease bucket's leader died; want at most %s", stood.Round(time.Millisecond), bound)
	}
	requireAlive(t, workers...)

	hw := c.finishProduction(prod)
	c.waitCaughtUp(hw, 60*time.Second)
	requireAlive(t, workers...)
	stopClean(t, workers...)
	rep := c.check(hw)
	if rep.StaleEpochs != 0 {
		t.Errorf("%d commits under a stale token", rep.StaleEpochs)
	}
}

func streamInfo(t *testing.T, js jetstream.JetStream, name string) *jetstream.StreamInfo {
	t.Helper()
	var info *jetstream.StreamInfo
	// A cluster that lost a server answers once a leader is elected.
	waitUntil(t, 20*time.Second, "the info of stream "+name, func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s, err := js.Stream(ctx, name)
		if err != nil {
			return false, err.Error()
		}
		info = s.CachedInfo()
		return true, ""
	})
	return info
}

// --nats-replicas above what the NATS server can hold (one server, not a
// cluster) stops the worker at start naming the setting.
func TestNATSReplicasAboveTheClusterNameTheSetting(t *testing.T) {
	b := setup(t, 1)
	b.cfg.NATSReplicas = 3
	w, err := worker.New(context.Background(), b.cfg, effects.Function(b.fn, b.topic))
	if err == nil {
		w.Close()
		t.Fatal("a worker with 3 replicas started on a single NATS server")
	}
	t.Logf("refused: %v", err)
	if !strings.Contains(err.Error(), "--nats-replicas (KFN_NATS_REPLICAS) 3 needs a NATS cluster of at least 3 servers") {
		t.Errorf("%v does not name --nats-replicas", err)
	}
}
