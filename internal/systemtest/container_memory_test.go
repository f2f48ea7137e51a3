//go:build container

package systemtest_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// The memory test runs the orders image in a container limited to
// memoryLimit, as the example manifests limit it, and feeds it a backlog
// of records of memoryRecordBytes on memoryPartitions partitions.
const (
	memoryLimit       = 256 << 20
	memoryPartitions  = 6
	memoryPerPart     = 80
	memoryRecordBytes = 900_000
)

// A worker in a container limited to 256 MiB applies a backlog of 900 KB
// records on 6 partitions (432 MB, more than the container may hold)
// exactly once, without being OOM-killed, and its peak memory is
// reported: the cgroup's (memory.max_usage_in_bytes, what the kernel's OOM
// killer counts, page cache included) and the worker process's peak RSS
// (VmHWM).
//
// Its batches are bounded in bytes (--batch-max-bytes, 8 MiB by default)
// as well as in count: with --batch-wait 1s a lane's batch would
// otherwise fill to its 80 records (72 MB) while the next one is read, and
// the 6 lanes would hold the whole backlog (with --batch-max-bytes 1 GiB,
// today's count-only bound, the container is OOM-killed). The worker sets its Go memory limit
// to 90% of the container's (it logs the value), and its settings fit it:
// it says nothing about memory at start.
func TestWorkerInAMemoryLimitedContainerAppliesLargeRecordsOnce(t *testing.T) {
	pm := newPodman(t)
	c := &chain{t: t, pg: kfntest.Postgres(t), kafka: kfntest.Kafka(t), nats: kfntest.NATSProcess(t), partitions: memoryPartitions}
	c.topic = c.kafka.CreateTopic(t, memoryPartitions)
	pm.buildImage()

	n := memoryPartitions * memoryPerPart
	for first := 0; first < n; first += memoryPartitions {
		msgs := make([]kafka.Message, 0, memoryPartitions)
		for i := first; i < first+memoryPartitions; i++ {
			o := order(i)
			msgs = append(msgs, kafka.Message{Partition: i % memoryPartitions, Key: []byte(o.ID), Value: paddedOrder(t, i)})
		}
		c.kafka.Produce(t, c.topic, msgs...)
	}
	t.Logf("produced %d orders of %d bytes each on %d partitions (%d MB)", n, memoryRecordBytes, memoryPartitions, n*memoryRecordBytes/1_000_000)

	name := pm.prefix + "-memory"
	pm.Run("run", "-d", "--name", name, "--network", "host",
		"--memory", strconv.Itoa(memoryLimit), "--memory-swap", strconv.Itoa(memoryLimit), // no swap: the limit is the limit
		"-e", "DATABASE_URL="+c.pg.URL,
		"-e", "KFN_KAFKA_BROKERS="+strings.Join(c.kafka.Brokers, ","),
		"-e", "KFN_NATS_URL="+c.nats.URL,
		"-e", "KFN_WORKER_ID="+name,
		"-e", "ORDERS_TOPIC="+c.topic,
		"-e", "KFN_MAX_RECORD_BYTES=1048576", // the records are 900 KB: not oversized
		"-e", "KFN_BATCH_WAIT=1s", // a batch fills to its bound, count or bytes
		containerImage+":dev")
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("last log lines of container %s:\n%s", name, pm.Logs(name, 40))
		}
		_ = pm.Command("rm", "-f", "-t", "0", name).Run()
	})
	peakFile := pm.memoryPeakFile(name)
	pid := pm.Run("inspect", "--format", "{{.State.Pid}}", name)
	started := time.Now()

	waitUntil(t, 3*time.Minute, "every order applied", func() (bool, string) {
		// runc on cgroup v1 may not report an OOM kill as such: a
		// container that stopped (exit code 137, SIGKILL) was killed.
		if state := pm.Run("inspect", "--format", "{{.State.Status}} {{.State.OOMKilled}} {{.State.ExitCode}}", name); !strings.HasPrefix(state, "running false") {
			t.Fatalf("container %s is %q (status, OOM-killed, exit code), want it running:\n%s", name, state, pm.Logs(name, 30))
		}
		got := c.tableCount("orders")
		return got == int64(n), fmt.Sprintf("%d of %d orders applied", got, n)
	})
	took := time.Since(started)
	c.requireAppliedOnce(n, 30*time.Second)

	peak := readBytesFile(t, peakFile)
	rss := peakRSS(t, pid)
	state := pm.Run("inspect", "--format", "{{.State.Status}} {{.State.OOMKilled}} {{.RestartCount}}", name)
	if state != "running false 0" {
		t.Errorf("container %s: status, OOM-killed, restarts = %q; want running, not OOM-killed, never restarted", name, state)
	}
	logs := pm.Logs(name, 1000)
	limitLine := logLine(logs, "memory limit set from the container's")
	if limitLine == nil || limitLine["go_memory_limit"] != "230 MiB" || limitLine["container_limit"] != "256 MiB" {
		t.Errorf("the worker's memory limit line: %v; want go_memory_limit 230 MiB (90%%) of container_limit 256 MiB", limitLine)
	}
	if strings.Contains(logs, `"msg":"memory: `) {
		t.Errorf("the worker said its settings do not fit its memory, and they do:\n%s", logs)
	}
	line := fmt.Sprintf("memory-limited container (podman --memory %d MiB): %d orders of %d KB on %d partitions applied exactly once in %s, not OOM-killed; peak memory: cgroup %.0f MiB (memory.max_usage_in_bytes), worker peak RSS %.0f MiB (VmHWM)",
		memoryLimit>>20, n, memoryRecordBytes/1000, memoryPartitions, took.Round(time.Second), float64(peak)/(1<<20), float64(rss)/(1<<20))
	t.Log(line)
	fmt.Println(line)
	pm.Run("stop", "-t", "30", name)
	if code := pm.ExitCode(name); code != 0 {
		t.Errorf("%s exited with code %d after podman stop, want 0\n%s", name, code, pm.Logs(name, 30))
	}
}

// paddedOrder is order i as JSON padded with white space to
// memoryRecordBytes: a valid order that the handler decodes whole.
func paddedOrder(t *testing.T, i int) []byte {
	t.Helper()
	v, err := json.Marshal(order(i))
	if err != nil {
		t.Fatal(err)
	}
	pad := bytes.Repeat([]byte(" "), memoryRecordBytes-len(v))
	return append(append([]byte("{"), pad...), v[1:]...)
}

// memoryPeakFile is the file of container name's cgroup that holds its
// peak memory use: memory.peak (cgroup v2) or memory.max_usage_in_bytes
// (v1), under the cgroup path podman reports.
func (pm *podman) memoryPeakFile(name string) string {
	pm.t.Helper()
	path := pm.Run("inspect", "--format", "{{.State.CgroupPath}}", name)
	for _, f := range []string{
		filepath.Join("/sys/fs/cgroup", path, "memory.peak"),
		filepath.Join("/sys/fs/cgroup/memory", path, "memory.max_usage_in_bytes"),
	} {
		if _, err := os.Stat(f); err == nil {
			return f
		}
	}
	pm.t.Fatalf("container %s: no memory.peak or memory.max_usage_in_bytes for its cgroup %q", name, path)
	return ""
}

// readBytesFile reads a cgroup file holding a number of bytes.
func readBytesFile(t *testing.T, file string) int64 {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
	if err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	return n
}

// peakRSS is the peak resident memory (VmHWM) of process pid, in bytes.
func peakRSS(t *testing.T, pid string) int64 {
	t.Helper()
	data, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kB, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatalf("VmHWM of %s: %q", pid, v)
			}
			return kB << 10
		}
	}
	t.Fatalf("no VmHWM in /proc/%s/status", pid)
	return 0
}

// logLine is the first JSON log line in logs whose message is msg.
func logLine(logs, msg string) map[string]any {
	for _, line := range strings.Split(logs, "\n") {
		var e map[string]any
		if json.Unmarshal([]byte(line), &e) == nil && e["msg"] == msg {
			return e
		}
	}
	return nil
}
