//go:build container

package systemtest_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/internal/podmantest"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// The container fault test runs the orders image the way it is deployed:
// built by deploy/image.sh, run by podman on the host network against this
// test's Postgres, NATS (a nats-server process) and Kafka on 127.0.0.1.
// It needs podman, so it is behind the container build tag
// (go tool task container:faults; CI runs it).
const (
	// containerImage is built by deploy/image.sh, which tags it :dev too.
	containerImage      = "kfn-orders-faults"
	containerPartitions = 12
	// containerOrders at containerRate keep the topic under load for the
	// whole scenario (about 30 s); the test fails if production ended
	// before the SIGTERM.
	containerOrders = 9000
	containerRate   = 300
	// containerStopTimeout is podman stop's wait between SIGTERM and
	// SIGKILL: far above what a shutdown needs (about 0.1 s), so that an
	// exit code other than 0 is the worker's, not podman's SIGKILL.
	containerStopTimeout = 60 * time.Second
	// containerHandoff is the promise measured here: every partition of a
	// container stopped with SIGTERM is claimed by another container within
	// this long of the signal.
	containerHandoff = time.Second
)

// Three containers of the orders image share a 12-partition topic while
// kfn produce feeds it. One is killed (podman kill: SIGKILL), then another
// is stopped (podman stop: SIGTERM). The stopped one must exit 0 and the
// last one must claim each of its partitions within containerHandoff of
// the signal; in the end every produced order is applied exactly once
// (one orders row per order, each with one revision, one inbox row per
// record) and none is dead-lettered.
func TestContainersKilledAndStoppedUnderLoad(t *testing.T) {
	start := time.Now()
	pm := newPodman(t)
	c := &chain{t: t, pg: kfntest.Postgres(t), kafka: kfntest.Kafka(t), nats: kfntest.NATSProcess(t), partitions: containerPartitions}
	c.topic = c.kafka.CreateTopic(t, containerPartitions)
	kfn := kfntest.BuildBinary(t, "github.com/kfn-dev/kfn/cmd/kfn")
	pm.buildImage()

	names := make([]string, 3)
	for i := range names {
		names[i] = pm.run(c, i+1)
	}
	producer := c.produceWithKfn(kfn, containerOrders, containerRate)
	produceStart := time.Now()
	c.waitOwners(names, 60*time.Second)
	t.Logf("%s in: 3 containers own the partitions, balanced", time.Since(start).Round(time.Millisecond))

	killed, stopped, last := names[0], names[1], names[2]
	pm.Run("kill", killed)
	killedAt := time.Now()
	c.waitOwners(names[1:], 60*time.Second)
	t.Logf("podman kill %s: its partitions were taken over after %s (lease TTL 5s)", killed, time.Since(killedAt).Round(time.Millisecond))

	before := c.claimsBy(stopped)
	select {
	case <-producer.Exited():
		t.Fatalf("kfn produce finished before the SIGTERM: the stop was not under load (raise containerOrders)")
	default:
		t.Logf("%s in: podman stop %s, %s into production", time.Since(start).Round(time.Millisecond), stopped, time.Since(produceStart).Round(time.Millisecond))
	}
	stopCalled := time.Now()
	stopDone := make(chan []byte, 1)
	go func() {
		out, _ := pm.Command("stop", "-t", strconv.Itoa(int(containerStopTimeout/time.Second)), stopped).CombinedOutput()
		stopDone <- out
	}()
	var claims map[int]time.Time
	waitUntil(t, 30*time.Second, last+" to claim every partition of "+stopped, func() (bool, string) {
		claims = c.claimsBy(last)
		for p := range before {
			if _, ok := claims[p]; !ok {
				return false, fmt.Sprintf("partition %d not claimed by %s yet", p, last)
			}
		}
		return true, ""
	})
	var out []byte
	select {
	case out = <-stopDone:
	case <-time.After(containerStopTimeout + 10*time.Second):
		t.Fatalf("podman stop %s did not return", stopped)
	}
	exited := time.Since(stopCalled)
	if code := pm.ExitCode(stopped); code != 0 {
		t.Errorf("%s exited with code %d after podman stop (SIGTERM, SIGKILL after %s), want 0; podman stop: %s\n%s", stopped, code, containerStopTimeout, out, pm.Logs(stopped, 30))
	}
	signalled := pm.SignalledAt(stopped)
	var lastClaim time.Time
	for p := range before {
		if claims[p].After(lastClaim) {
			lastClaim = claims[p]
		}
	}
	handoff := lastClaim.Sub(signalled)
	line := fmt.Sprintf("container stop (podman stop, %d orders/s): %s exited 0 %s after podman stop was called; %s claimed its %d partitions %s after the SIGTERM reached it (%s after podman stop was called)",
		containerRate, stopped, exited.Round(time.Millisecond), last, len(before), handoff.Round(time.Millisecond), lastClaim.Sub(stopCalled).Round(time.Millisecond))
	t.Log(line)
	fmt.Println(line)
	// The phases of the handoff, from both sides' logs, timed from the
	// SIGTERM: logged every time (CI runs -v), so a slow run shows its
	// cause.
	t.Log("the handoff's phases, in ms after the SIGTERM reached " + stopped + ":\n" +
		pm.phases(stopped, signalled, lastClaim, stoppingPhases) + pm.phases(last, signalled, lastClaim, takingPhases))
	if handoff > containerHandoff {
		t.Errorf("the partitions of %s were claimed %s after its SIGTERM, over %s", stopped, handoff, containerHandoff)
	}

	select {
	case <-producer.Exited():
	case <-time.After(2 * time.Minute):
		t.Fatalf("kfn produce did not finish:\n%s", producer.LogTail(10))
	}
	if err := producer.ExitErr(); err != nil {
		t.Fatalf("kfn produce: %v\n%s", err, producer.LogTail(10))
	}
	c.requireAppliedOnce(containerOrders, 60*time.Second)
	pm.Run("stop", "-t", strconv.Itoa(int(containerStopTimeout/time.Second)), last)
	if code := pm.ExitCode(last); code != 0 {
		t.Errorf("%s exited with code %d after podman stop, want 0\n%s", last, code, pm.Logs(last, 30))
	}
}

// podman runs podman for the test; its containers are named with prefix.
type podman struct {
	*podmantest.Podman
	t      *testing.T
	prefix string // of this test's container names
}

func newPodman(t *testing.T) *podman {
	t.Helper()
	return &podman{Podman: podmantest.New(t, "../.."), t: t, prefix: fmt.Sprintf("kfn-orders-%d", os.Getpid())}
}

// buildImage builds the orders image with deploy/image.sh.
func (pm *podman) buildImage() {
	pm.t.Helper()
	pm.BuildImage(filepath.Join(pm.Root, "functions", "orders", "cmd", "orders"), containerImage)
}

// run starts container n of the orders image on the host network against
// c's services, its worker id the container's name, and removes it when
// the test ends (showing its log if the test failed).
func (pm *podman) run(c *chain, n int) string {
	pm.t.Helper()
	name := fmt.Sprintf("%s-%d", pm.prefix, n)
	pm.Run("run", "-d", "--name", name, "--network", "host",
		"-e", "DATABASE_URL="+c.pg.URL,
		"-e", "KFN_KAFKA_BROKERS="+strings.Join(c.kafka.Brokers, ","),
		"-e", "KFN_NATS_URL="+c.nats.URL,
		"-e", "KFN_WORKER_ID="+name,
		"-e", "ORDERS_TOPIC="+c.topic,
		"-e", "KFN_LOG_LEVEL=debug", // the phases of the handoff are per lane and lease

		containerImage+":dev")
	pm.t.Cleanup(func() {
		if pm.t.Failed() {
			pm.t.Logf("last log lines of container %s:\n%s", name, pm.Logs(name, 40))
		}
		_ = pm.Command("rm", "-f", "-t", "0", name).Run()
	})
	return name
}

// Log lines of a handoff's phases (engine and package lease): the
// stopping worker's, and the taking worker's.
var (
	stoppingPhases = []string{"stopping:", "lane stopped", "stopping claim", "released", "claim ended", "lease manager stopped", "worker stopped cleanly"}
	takingPhases   = []string{"member", "lease held elsewhere", "claimed", "partition claimed", "claim partition failed", "stopping claim", "released", "claim ended", "lane stopped"}
)

// phases returns the log lines of container name from from on, up to a
// second past until, whose message starts with one of msgs, each with its
// time in milliseconds after from, one per line.
func (pm *podman) phases(name string, from, until time.Time, msgs []string) string {
	pm.t.Helper()
	out, err := pm.Command("logs", name).CombinedOutput()
	if err != nil {
		return fmt.Sprintf("(podman logs %s: %v)\n", name, err)
	}
	var b strings.Builder
	for line := range bytes.Lines(out) {
		var e map[string]any
		if json.Unmarshal(line, &e) != nil {
			continue
		}
		at, err := time.Parse(time.RFC3339Nano, fmt.Sprint(e["time"]))
		msg := fmt.Sprint(e["msg"])
		if err != nil || at.Before(from.Add(-time.Millisecond)) || at.After(until.Add(time.Second)) ||
			!slices.ContainsFunc(msgs, func(m string) bool { return strings.HasPrefix(msg, m) }) {
			continue
		}
		fmt.Fprintf(&b, "  %6d  %s: %s", at.Sub(from).Milliseconds(), name, msg)
		for _, k := range slices.Sorted(maps.Keys(e)) {
			if !slices.Contains([]string{"time", "level", "msg", "group", "member", "topic", "bucket"}, k) {
				fmt.Fprintf(&b, " %s=%v", k, e[k])
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

// produceWithKfn starts kfn produce, sending n orders (order i keyed by
// its id) at rate a second to the chain's topic.
func (c *chain) produceWithKfn(kfn string, n, rate int) *kfntest.Process {
	c.t.Helper()
	var lines bytes.Buffer
	for i := range n {
		o := order(i)
		v, err := json.Marshal(o)
		if err != nil {
			c.t.Fatal(err)
		}
		fmt.Fprintf(&lines, "{\"key\": %q, \"value\": %s}\n", o.ID, v)
	}
	file := filepath.Join(c.t.TempDir(), "orders.jsonl")
	if err := os.WriteFile(file, lines.Bytes(), 0o600); err != nil {
		c.t.Fatal(err)
	}
	cmd := exec.Command(kfn, "produce", c.topic, "--file", file, "--rate", strconv.Itoa(rate))
	cmd.Env = append(os.Environ(), "KFN_KAFKA_BROKERS="+strings.Join(c.kafka.Brokers, ","))
	return kfntest.StartProcess(c.t, cmd)
}

// claimsBy returns when worker id claimed each partition it owns now.
func (c *chain) claimsBy(id string) map[int]time.Time {
	c.t.Helper()
	claims, err := effects.ClaimedAt(context.Background(), c.pg.Pool, orders.Function().Name, c.topic, id)
	if err != nil {
		c.t.Fatal(err)
	}
	return claims
}

// waitOwners waits until the workers live own every partition, each of
// them its share, and each owner has committed since its claim.
func (c *chain) waitOwners(live []string, limit time.Duration) {
	c.t.Helper()
	waitUntil(c.t, limit, fmt.Sprintf("%v to own every partition, balanced", live), func() (bool, string) {
		rows, err := c.pg.Pool.Query(context.Background(),
			`SELECT partition, owner, updated_at > claimed_at FROM kfn.cursors WHERE consumer = 'orders' AND topic = $1`, c.topic)
		if err != nil {
			return false, err.Error()
		}
		defer rows.Close()
		count, n := map[string]int{}, 0
		for rows.Next() {
			var p int
			var owner string
			var committed bool
			if err := rows.Scan(&p, &owner, &committed); err != nil {
				return false, err.Error()
			}
			if !slices.Contains(live, owner) || !committed {
				return false, fmt.Sprintf("partition %d: owner %s, committed since its claim: %v", p, owner, committed)
			}
			count[owner]++
			n++
		}
		if err := rows.Err(); err != nil {
			return false, err.Error()
		}
		share := (c.partitions + len(live) - 1) / len(live)
		for _, id := range slices.Sorted(maps.Keys(count)) {
			if count[id] > share {
				return false, fmt.Sprintf("%s owns %d partitions, more than its share %d", id, count[id], share)
			}
		}
		return n == c.partitions, fmt.Sprintf("%d of %d partitions have a cursor", n, c.partitions)
	})
}

// requireAppliedOnce waits until every record of the topic is handled, then
// requires n orders, each applied once: one row per order id with one
// revision (a second apply upserts a second revision), one inbox row per
// record, and no dead letter.
func (c *chain) requireAppliedOnce(n int, limit time.Duration) {
	c.t.Helper()
	hw := c.kafka.HighWatermarks(c.t, c.topic)
	var total int64
	for _, end := range hw {
		total += end
	}
	if total != int64(n) {
		c.t.Fatalf("the topic holds %d records, want the %d produced", total, n)
	}
	waitUntil(c.t, limit, "the cursors to reach the high watermarks", func() (bool, string) {
		for p, end := range hw {
			var next int64
			err := c.pg.Pool.QueryRow(context.Background(),
				`SELECT next_offset FROM kfn.cursors WHERE consumer = 'orders' AND topic = $1 AND partition = $2`, c.topic, p).Scan(&next)
			if err != nil || next < end {
				return false, fmt.Sprintf("partition %d at %d of %d (%v)", p, next, end, err)
			}
		}
		return true, ""
	})
	rows := c.count(`SELECT count(*) FROM orders`)
	revisions := c.count(`SELECT coalesce(sum(revisions), 0) FROM orders`)
	inboxRows := c.count(`SELECT count(*) FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = 'orders' AND topic = $1`, c.topic)
	dead := c.count(`SELECT count(*) FROM kfn.dead_letters WHERE consumer = 'orders'`)
	lost, duplicated := int64(n)-rows, revisions-rows
	c.t.Logf("produced %d orders: %d rows (lost %d), %d applies (duplicated %d), %d inbox rows, %d dead letters", n, rows, lost, revisions, duplicated, inboxRows, dead)
	if lost != 0 || duplicated != 0 || inboxRows != int64(n) || dead != 0 {
		c.t.Errorf("exactly-once violated: lost %d, duplicated %d, inbox rows %d of %d, dead letters %d", lost, duplicated, inboxRows, n, dead)
	}
}
