package bench

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// This file measures memory from Linux's /proc. The benchmark process's
// peak is its VmHWM, restarted at each mode's start (/proc/self/clear_refs),
// so each mode gets its own peak. A Postgres server's is not a peak: the
// kernel keeps none over a process tree, and sampling during the mode would
// cost CPU the mode is charged for. It is what its processes hold at the
// mode's end, before the mode's connections close: the private memory
// (RssAnon) of the postmaster and every backend, summed, plus the largest
// shared memory (RssShmem: shared buffers) one of them has touched, once.

// resetPeakRSS restarts this process's VmHWM from its current RSS; false
// where the kernel does not allow it (the peak then runs from the start).
func resetPeakRSS() bool {
	return os.WriteFile("/proc/self/clear_refs", []byte("5"), 0) == nil
}

// peakRSS is this process's VmHWM in bytes; 0 if unknown.
func peakRSS() int64 {
	return kBFields("/proc/self/status")["VmHWM"]
}

// residentMemory is the memory a process tree holds now, in bytes: its
// processes' private memory summed, plus the largest shared memory one of
// them maps; 0 if unknown.
func residentMemory(pid int) int64 {
	var private, shared int64
	for _, p := range append([]int{pid}, descendants(readAllStats(), pid)...) {
		f := kBFields(fmt.Sprintf("/proc/%d/status", p))
		private += f["RssAnon"]
		shared = max(shared, f["RssShmem"])
	}
	return private + shared
}

// kBFields reads the "Name: n kB" fields of a /proc file
// (/proc/<pid>/status, /proc/meminfo), in bytes.
func kBFields(path string) map[string]int64 {
	out := map[string]int64{}
	f, err := os.Open(path)
	if err != nil {
		return out
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), ":")
		value, kB := strings.CutSuffix(strings.TrimSpace(value), " kB")
		if !ok || !kB {
			continue
		}
		if n, err := strconv.ParseInt(value, 10, 64); err == nil {
			out[name] = n << 10
		}
	}
	return out
}

// MiB formats bytes as mebibytes; "-" for unknown (0).
func MiB(bytes int64) string {
	if bytes <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f MiB", float64(bytes)/(1<<20))
}
