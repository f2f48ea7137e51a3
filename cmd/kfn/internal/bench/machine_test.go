package bench

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"runtime/debug"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// The machine's description names the CPU, the memory and the OS, and its
// class the CPUs and the memory.
func TestDescribeMachine(t *testing.T) {
	m := DescribeMachine()
	t.Logf("%s (class %s)", m, m.Class())
	if m.CPU == "unknown" || m.CPUs < 1 || m.Memory < 1<<28 || m.OS == "unknown" || m.Load == "unknown" {
		t.Errorf("machine %+v: want the CPU, the memory, the OS and the load read", m)
	}
	if !regexp.MustCompile(`^\d+cpu-\d+gib$`).MatchString(m.Class()) {
		t.Errorf("class %q; want <n>cpu-<n>gib", m.Class())
	}
}

// A broker's version comes from its server jar on the class path, given
// as a directory/* entry as kafka.sh gives it, relative or absolute.
func TestKafkaVersionReadsTheServerJar(t *testing.T) {
	dir := t.TempDir()
	for _, jar := range []string{"kafka-clients-4.4.0.jar", "kafka_2.13-4.4.0.jar", "scala-library-2.13.16.jar"} {
		if err := os.WriteFile(filepath.Join(dir, jar), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct{ cwd, classpath, want string }{
		{"/", filepath.Join(dir, "*"), "4.4.0"},
		{dir, "*", "4.4.0"},
		{"/", "/nonexistent/*", ""},
	} {
		// sh -c 'script' arg0 args…: the class path shows in its command
		// line. The script ends in ":", so sh waits for sleep instead of
		// replacing itself with it (and its command line with sleep's).
		cmd := exec.Command("sh", "-c", "sleep 30; :", "java", "-Xmx256m", "-cp", tc.classpath, "kafka.Kafka")
		cmd.Dir = tc.cwd
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Start returns as soon as the child's exec has replaced its memory,
		// which is before the kernel has set the new command line up: read
		// it only once it is sh's (a broker's is set long before bench
		// asks).
		cmdline := fmt.Sprintf("/proc/%d/cmdline", cmd.Process.Pid)
		set := kfntest.Await(t, 5*time.Second, "sh's command line", func() (bool, string) {
			b, err := os.ReadFile(cmdline)
			return err == nil && bytes.Contains(b, []byte("kafka.Kafka")), fmt.Sprintf("%q, %v", b, err)
		})
		got := KafkaVersion(cmd.Process.Pid)
		cmd.Process.Kill()
		cmd.Wait()
		if set && got != tc.want {
			t.Errorf("-cp %s in %s: version %q; want %q", tc.classpath, tc.cwd, got, tc.want)
		}
	}
}

// The commit latency is over records: a batch counts as many times as it
// has records.
func TestCommitLatencyIsOverRecords(t *testing.T) {
	var c commitTimes
	c.add(1, 900*time.Millisecond) // one slow transaction of one record
	for range 10 {
		c.add(100, 10*time.Millisecond)
	}
	c.add(20, 50*time.Millisecond)
	got := c.latency()
	// 1,021 records: p50 and p99 (rank 1,010) fall in the 10 ms batches.
	if got != (Latency{P50: 10 * time.Millisecond, P99: 50 * time.Millisecond, Transactions: 12}) {
		t.Errorf("latency = %+v; want p50 10ms, p99 50ms over 12 transactions", got)
	}
	if (&commitTimes{}).latency() != (Latency{}) {
		t.Errorf("no transactions: want zero latency")
	}
}

// The peak RSS restarts at each mode: after a reset it no longer holds a
// freed allocation's pages.
func TestPeakRSSRestarts(t *testing.T) {
	const size = 128 << 20
	buf := make([]byte, size)
	for i := 0; i < size; i += 4096 {
		buf[i] = 1
	}
	peak := peakRSS()
	if peak < size {
		t.Fatalf("peak RSS %d with %d bytes touched", peak, size)
	}
	runtime.KeepAlive(buf)
	buf = nil
	debug.FreeOSMemory()
	if !resetPeakRSS() {
		t.Fatal("cannot reset the peak RSS (/proc/self/clear_refs)")
	}
	if after := peakRSS(); after > peak-size/2 {
		t.Errorf("peak RSS %d after the reset, %d before; want it down by the freed %d", after, peak, size)
	}
}
