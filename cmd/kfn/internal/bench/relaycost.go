package bench

import (
	"bufio"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// processCost is what this process has spent so far: CPU time (user and
// system), heap allocations, and read and write system calls (Linux's
// /proc/self/io syscr and syscw, which count the socket reads and writes
// of the Postgres and NATS connections; -1 where unknown). The relay
// benchmark reads it before and after a phase.
type processCost struct {
	cpu      time.Duration
	mallocs  uint64
	bytes    uint64
	syscalls int64
}

func readProcessCost() processCost {
	var c processCost
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		c.cpu = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	c.mallocs, c.bytes = ms.Mallocs, ms.TotalAlloc
	c.syscalls = readWriteSyscalls()
	return c
}

func readWriteSyscalls() int64 {
	f, err := os.Open("/proc/self/io")
	if err != nil {
		return -1
	}
	defer f.Close()
	var n int64
	found := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), ": ")
		if !ok || name != "syscr" && name != "syscw" {
			continue
		}
		v, err := strconv.ParseInt(value, 10, 64)
		if err != nil {
			return -1
		}
		n += v
		found++
	}
	if found != 2 {
		return -1
	}
	return n
}

// EventCost is what relaying cost per event in one phase of the relay
// benchmark, in the benchmark's own process (the relay, its Postgres and
// NATS clients; Postgres and NATS run as processes of their own).
type EventCost struct {
	CPU      time.Duration // user + system CPU time per event
	Allocs   float64       // heap allocations per event
	Bytes    float64       // heap bytes allocated per event
	Syscalls float64       // read and write system calls per event; -1 if unknown
}

// perEvent divides the cost spent since start over events.
func (start processCost) perEvent(events int) EventCost {
	end := readProcessCost()
	n := float64(max(events, 1))
	c := EventCost{
		CPU:      time.Duration(float64(end.cpu-start.cpu) / n),
		Allocs:   float64(end.mallocs-start.mallocs) / n,
		Bytes:    float64(end.bytes-start.bytes) / n,
		Syscalls: -1,
	}
	if start.syscalls >= 0 && end.syscalls >= 0 {
		c.Syscalls = float64(end.syscalls-start.syscalls) / n
	}
	return c
}

func (c EventCost) String() string {
	return strconv.FormatFloat(float64(c.CPU)/float64(time.Microsecond), 'f', 1, 64) + " µs CPU, " +
		strconv.FormatFloat(c.Allocs, 'f', 1, 64) + " allocs (" + strconv.FormatFloat(c.Bytes, 'f', 0, 64) + " B), " +
		strconv.FormatFloat(c.Syscalls, 'f', 2, 64) + " read/write syscalls per event"
}
