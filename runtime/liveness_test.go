package runtime_test

import (
	"bufio"
	"context"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// The liveness tests (invariant I8) break one service for one or all
// workers under load, and measure how long each lane stood still against
// the lease TTL, besides the checker's counts (lost, duplicated, reordered,
// stale-epoch commits), which must all be zero.

// One worker's path to Postgres freezes: a proxy stops forwarding but keeps
// every socket open, for 10 × TTL. Its open transactions hang, while it can
// still renew its NATS leases. Its probe finds Postgres unreachable, so it
// steps out: it releases its leases and leaves the group, and the other
// workers take each of its partitions over and commit on it within TTL + 2 s
// of the freeze (each claim ends the frozen session that holds the cursor
// row, if any). Thawed, it rejoins and commits nothing under its old terms.
func TestLivenessFrozenPostgresPath(t *testing.T) {
	c := newCluster(t)
	frozenID := c.nextID()
	u, err := url.Parse(c.databaseURL(frozenID))
	if err != nil {
		t.Fatal(err)
	}
	proxy := kfntest.PostgresProxy(t, u.Host)
	u.Host = proxy.Addr()
	frozen := c.startWorkerEnv(frozenID, "DATABASE_URL="+u.String())
	workers := append([]*proc{frozen}, c.startWorkers(2)...)
	prod := c.startProducer()
	c.waitBalanced(ids(workers), 30*time.Second)

	before := ownedBy(c.cursors(), frozen.id)
	if len(before) == 0 {
		t.Fatalf("%s owns no partition", frozen.id)
	}
	var oldTokens []int64
	for _, cur := range before {
		oldTokens = append(oldTokens, cur.epoch)
	}
	proxy.Freeze()
	frozenAt := time.Now()
	stood := c.waitTakenOver(frozenAt, before, func(old, cur cursor) bool {
		return cur.owner != frozen.id && cur.epoch > old.epoch
	}, "the other workers to take over and commit on each of "+frozen.id+"'s partitions")
	limit := failoverTTL + 2*time.Second
	reportStillness(t, "frozen Postgres path", stood, limit)

	// Frozen for 10 × TTL in all; the others carry the load meanwhile.
	time.Sleep(time.Until(frozenAt.Add(10 * failoverTTL)))
	if n := len(ownedBy(c.cursors(), frozen.id)); n != 0 {
		t.Errorf("%s owns %d partitions in Postgres while its path is frozen", frozen.id, n)
	}
	oldRows := c.inboxRowsWithEpochs(oldTokens)
	proxy.Thaw()
	thawed := time.Now()
	c.waitBalanced(ids(workers), 30*time.Second)
	t.Logf("path frozen for %s; %s rejoined and the three workers were balanced %s after the thaw",
		thawed.Sub(frozenAt).Round(time.Millisecond), frozen.id, time.Since(thawed).Round(time.Millisecond))
	requireAlive(t, workers...)

	hw := c.finishLoad(prod, workers...)
	if n := c.inboxRowsWithEpochs(oldTokens); n != oldRows {
		t.Errorf("%s committed %d records under its old tokens %v after the thaw", frozen.id, n-oldRows, oldTokens)
	}
	c.check(hw)
}

// The Kafka broker (a private one: the shared broker must stay up) stops
// for 30 s under load. The lanes wait and keep their leases: no epoch
// changes in kfn.cursors, the lag stays exported with its last value, and
// reading resumes within 5 s of the broker's return.
func TestLivenessKafkaOutage(t *testing.T) {
	const outage = 30 * time.Second
	pk := kfntest.NewPrivateKafka(t)
	c := newClusterOn(t, pk.KafkaCluster)
	var workers []*proc
	for range 3 {
		workers = append(workers, c.startWorker(c.nextID()))
	}
	prod := c.startProducer()
	c.waitBalanced(ids(workers), 30*time.Second)
	epochs := epochsOf(c.cursors())

	prod.expectErrors.Store(true)
	pk.Stop()
	stopped := time.Now()
	t.Logf("broker stopped; %d partitions at epochs %v", len(epochs), epochs)
	var lagSeen map[int]int64
	for time.Since(stopped) < outage {
		time.Sleep(time.Second)
		if now := epochsOf(c.cursors()); !maps.Equal(now, epochs) {
			t.Fatalf("epochs changed %s into the Kafka outage: %v, before %v", time.Since(stopped).Round(time.Millisecond), now, epochs)
		}
		if lagSeen == nil && time.Since(stopped) > outage/2 {
			lagSeen = scrapeLag(t, workers)
		}
		requireAlive(t, workers...)
	}
	if len(lagSeen) != failoverPartitions {
		t.Errorf("halfway through the outage the workers export the lag of partitions %v; want all %d", slices.Sorted(maps.Keys(lagSeen)), failoverPartitions)
	}
	t.Logf("lag exported halfway through the outage, per partition: %v", lagSeen)

	if err := pk.Start(); err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	// One record per partition, written as soon as the broker answers: the
	// lanes have read again once their cursors pass it.
	pending := producedNow(t, c)
	wrote := time.Since(started)
	stood := c.waitTakenOver(started, pending, func(old, cur cursor) bool { return true },
		"every partition to read and commit again after the broker's return")
	reportStillness(t, "Kafka outage (from the broker's return; first records written after "+wrote.Round(time.Millisecond).String()+")", stood, 5*time.Second)
	if now := epochsOf(c.cursors()); !maps.Equal(now, epochs) {
		t.Errorf("epochs changed over the Kafka outage: %v, before %v", now, epochs)
	}
	time.Sleep(2 * time.Second) // the producer's writer reconnects too
	prod.expectErrors.Store(false)
	t.Logf("producer writes that failed during the outage: %d", prod.expected.Load())

	requireAlive(t, workers...)
	hw := c.finishLoad(prod, workers...)
	c.check(hw)
}

// The lease bucket is deleted under load. The workers create it again by
// themselves, with tokens above every epoch stored in Postgres, and wait
// until the lost leases have run out before they take any: processing
// resumes within 2 × TTL, with no manual step and no stale-epoch commit.
func TestLivenessLeaseBucketDeleted(t *testing.T) {
	c := newCluster(t)
	workers, prod := c.startLoad(3)

	nc, err := nats.Connect(c.nats.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	before := c.cursors()
	var maxEpoch int64
	for _, cur := range before {
		maxEpoch = max(maxEpoch, cur.epoch)
	}
	if err := js.DeleteKeyValue(ctx, lease.DefaultBucket); err != nil {
		t.Fatal(err)
	}
	deleted := time.Now()
	stood := c.waitTakenOver(deleted, before, func(old, cur cursor) bool { return cur.epoch > maxEpoch },
		"every partition to be claimed with a token above every stored epoch and committed")
	reportStillness(t, "lease bucket deleted", stood, 2*failoverTTL)

	store, err := lease.OpenExisting(ctx, js, lease.DefaultBucket, nil)
	if err != nil {
		t.Fatal(err)
	}
	base, err := store.TokenBase(ctx)
	if err != nil {
		t.Fatal(err)
	}
	epochs := epochsOf(c.cursors())
	t.Logf("largest epoch before the deletion %d; the new bucket's token base %d; epochs now %v", maxEpoch, base, epochs)
	if base < uint64(maxEpoch) {
		t.Errorf("the new bucket's token base %d is below the largest stored epoch %d", base, maxEpoch)
	}
	for p, e := range epochs {
		if e <= int64(base) {
			t.Errorf("partition %d: epoch %d is not above the new bucket's base %d", p, e, base)
		}
	}

	c.waitBalanced(ids(workers), 30*time.Second)
	requireAlive(t, workers...)
	hw := c.finishLoad(prod, workers...)
	c.check(hw)
}

// waitTakenOver waits until every partition of before has committed past
// its position in before under an owner that passes ok, and returns, per
// partition, how long after since that happened: how long its lane stood
// still.
func (c *cluster) waitTakenOver(since time.Time, before map[int]cursor, ok func(old, cur cursor) bool, what string) map[int]time.Duration {
	c.t.Helper()
	stood := map[int]time.Duration{}
	waitUntil(c.t, 30*time.Second, what, func() (bool, string) {
		curs := c.cursors()
		var waiting []string
		for p, old := range before {
			if _, done := stood[p]; done {
				continue
			}
			if cur := curs[p]; cur.committed && cur.next > old.next && ok(old, cur) {
				stood[p] = time.Since(since)
			} else {
				waiting = append(waiting, fmt.Sprintf("partition %d: %+v (before: %+v)", p, cur, old))
			}
		}
		return len(waiting) == 0, strings.Join(waiting, "\n")
	})
	return stood
}

// reportStillness logs how long each lane stood still and fails the test
// for each one over limit.
func reportStillness(t *testing.T, what string, stood map[int]time.Duration, limit time.Duration) {
	t.Helper()
	var worst time.Duration
	var parts []string
	for _, p := range slices.Sorted(maps.Keys(stood)) {
		parts = append(parts, fmt.Sprintf("%d:%s", p, stood[p].Round(time.Millisecond)))
		worst = max(worst, stood[p])
	}
	line := fmt.Sprintf("%s: lanes stood still for (partition:time) %s; worst %s, limit %s (lease TTL %s)",
		what, strings.Join(parts, " "), worst.Round(time.Millisecond), limit, failoverTTL)
	t.Log(line)
	fmt.Println(line)
	for p, d := range stood {
		if d > limit {
			t.Errorf("partition %d stood still for %s, over %s", p, d.Round(time.Millisecond), limit)
		}
	}
}

func epochsOf(curs map[int]cursor) map[int]int64 {
	out := map[int]int64{}
	for p, cur := range curs {
		out[p] = cur.epoch
	}
	return out
}

// producedNow waits until the broker answers, writes one record to every
// partition, and returns the cursors a lane must pass to have read and
// committed it.
func producedNow(t *testing.T, c *cluster) map[int]cursor {
	t.Helper()
	waitUntil(t, 30*time.Second, "the broker to answer", func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if _, err := c.kafka.ReadHighWatermarks(ctx, c.topic); err != nil {
			return false, err.Error()
		}
		return true, ""
	})
	msgs := make([]kafka.Message, failoverPartitions)
	for p := range msgs {
		msgs[p] = kafka.Message{Partition: p, Key: []byte("k" + strconv.Itoa(p)), Value: []byte("after the outage")}
	}
	c.kafka.Produce(t, c.topic, msgs...)
	out := map[int]cursor{}
	for p, end := range c.kafka.HighWatermarks(t, c.topic) {
		out[p] = cursor{partition: p, next: end - 1} // at least the record just written
	}
	return out
}

// scrapeLag reads kfn_partition_lag from every worker's /metrics and
// returns it per partition.
func scrapeLag(t *testing.T, workers []*proc) map[int]int64 {
	t.Helper()
	out := map[int]int64{}
	client := &http.Client{Timeout: 5 * time.Second}
	for _, w := range workers {
		id := w.id
		resp, err := client.Get("http://" + w.metricsAddr() + "/metrics")
		if err != nil {
			t.Errorf("metrics of %s: %v", id, err)
			continue
		}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			line := sc.Text()
			if !strings.HasPrefix(line, "kfn_partition_lag{") {
				continue
			}
			_, rest, _ := strings.Cut(line, `partition="`)
			part, rest, _ := strings.Cut(rest, `"`)
			_, value, _ := strings.Cut(rest, "} ")
			p, perr := strconv.Atoi(part)
			v, verr := strconv.ParseFloat(value, 64)
			if perr != nil || verr != nil {
				t.Errorf("metrics of %s: cannot parse %q", id, line)
				continue
			}
			out[p] = int64(v)
		}
		resp.Body.Close()
	}
	return out
}
