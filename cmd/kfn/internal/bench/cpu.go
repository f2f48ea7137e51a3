package bench

import (
	"bytes"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// This file measures CPU time per process from Linux's /proc: a process's
// utime+stime, plus, for a server that forks (Postgres' postmaster and its
// backends), the time of every live descendant and of the children it has
// reaped (cutime+cstime). The processes are found by the TCP ports the
// services listen on, so a throwaway cluster, a local Postgres, a
// nats-server process and an Apache Kafka broker (its java process) are all
// counted; a service in this process (the embedded NATS server and Kafka
// broker) is counted in this process's time.

// clockTicks is Linux's USER_HZ, the unit of /proc/<pid>/stat times: 100
// on every architecture Go supports.
const clockTicks = 100

// Process is one process whose CPU time the benchmark counts.
type Process struct {
	Name string // what it is: "kfn bench", "postgres", "nats-server", "kafka"
	PID  int
	Tree bool // count its descendants, live and reaped, too
}

// FindProcesses returns this process and the local processes listening on
// the ports of the given services (addresses as host:port; a service in
// this process, or not on this machine, is left out): the process tree of
// each, named after its service.
func FindProcesses(services map[string][]string) []Process {
	self := os.Getpid()
	procs := []Process{{Name: "kfn bench", PID: self}}
	listeners := listeningInodes()
	owners := socketOwners()
	seen := map[int]bool{self: true}
	for _, name := range slices.Sorted(maps.Keys(services)) {
		for _, addr := range services[name] {
			_, port, err := net.SplitHostPort(addr)
			if err != nil {
				continue
			}
			p, _ := strconv.Atoi(port)
			pid, ok := owners[listeners[p]]
			if !ok || seen[pid] {
				continue
			}
			seen[pid] = true
			procs = append(procs, Process{Name: name, PID: pid, Tree: true})
		}
	}
	return procs
}

// InThisProcess reports whether one of addrs (host:port) is served by a
// listener of this process: an embedded service.
func InThisProcess(addrs []string) bool {
	listeners := listeningInodes()
	owners := socketOwners()
	for _, addr := range addrs {
		_, port, err := net.SplitHostPort(addr)
		if err != nil {
			continue
		}
		p, _ := strconv.Atoi(port)
		if pid, ok := owners[listeners[p]]; ok && pid == os.Getpid() {
			return true
		}
	}
	return false
}

// CPU is CPU time by process name.
type CPU map[string]time.Duration

// Total is the CPU time of every process.
func (c CPU) Total() time.Duration {
	var t time.Duration
	for _, d := range c {
		t += d
	}
	return t
}

// Sub returns c - before, by process.
func (c CPU) Sub(before CPU) CPU {
	out := CPU{}
	for name, d := range c {
		out[name] = d - before[name]
	}
	return out
}

// SampleCPU reads the CPU time the processes have used so far.
func SampleCPU(procs []Process) CPU {
	stats := readAllStats()
	out := CPU{}
	for _, p := range procs {
		st, ok := stats[p.PID]
		if !ok {
			continue
		}
		ticks := st.utime + st.stime
		if p.Tree {
			ticks += st.cutime + st.cstime
			for _, pid := range descendants(stats, p.PID) {
				c := stats[pid]
				ticks += c.utime + c.stime + c.cutime + c.cstime
			}
		}
		out[p.Name] += time.Duration(ticks) * time.Second / clockTicks
	}
	return out
}

// descendants lists the live descendants of pid.
func descendants(stats map[int]procStat, pid int) []int {
	children := map[int][]int{}
	for pid, st := range stats {
		children[st.ppid] = append(children[st.ppid], pid)
	}
	var out []int
	stack := append([]int(nil), children[pid]...)
	for len(stack) > 0 {
		p := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		out = append(out, p)
		stack = append(stack, children[p]...)
	}
	return out
}

type procStat struct {
	ppid                         int
	utime, stime, cutime, cstime int64
}

// readAllStats reads /proc/<pid>/stat of every process.
func readAllStats() map[int]procStat {
	out := map[int]procStat{}
	dirs, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, path := range dirs {
		data, err := os.ReadFile(path)
		if err != nil {
			continue // it exited
		}
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(path)))
		if st, ok := parseStat(data); ok {
			out[pid] = st
		}
	}
	return out
}

// parseStat reads the fields of a /proc/<pid>/stat line it needs; the
// command name, in parentheses, may hold spaces and parentheses.
func parseStat(data []byte) (procStat, bool) {
	end := bytes.LastIndexByte(data, ')')
	if end < 0 {
		return procStat{}, false
	}
	f := strings.Fields(string(data[end+1:]))
	// f[0] is field 3 (state): ppid is field 4, utime..cstime 14..17.
	if len(f) < 15 {
		return procStat{}, false
	}
	n := func(i int) int64 { v, _ := strconv.ParseInt(f[i-3], 10, 64); return v }
	return procStat{ppid: int(n(4)), utime: n(14), stime: n(15), cutime: n(16), cstime: n(17)}, true
}

// listeningInodes maps each local TCP port in state LISTEN to its socket's
// inode, from /proc/net/tcp and tcp6.
func listeningInodes() map[int]string {
	out := map[int]string{}
	for _, file := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		data, err := os.ReadFile(file)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(data), "\n")[1:] {
			f := strings.Fields(line)
			if len(f) < 10 || f[3] != "0A" { // 0A: LISTEN
				continue
			}
			_, portHex, ok := strings.Cut(f[1], ":")
			if !ok {
				continue
			}
			port, err := strconv.ParseInt(portHex, 16, 32)
			if err == nil {
				out[int(port)] = f[9]
			}
		}
	}
	return out
}

// socketOwners maps socket inodes to a process holding them.
func socketOwners() map[string]int {
	out := map[string]int{}
	fds, _ := filepath.Glob("/proc/[0-9]*/fd/*")
	for _, fd := range fds {
		target, err := os.Readlink(fd)
		if err != nil || !strings.HasPrefix(target, "socket:[") {
			continue
		}
		pid, _ := strconv.Atoi(strings.Split(fd, "/")[2])
		inode := strings.TrimSuffix(strings.TrimPrefix(target, "socket:["), "]")
		if old, ok := out[inode]; !ok || pid < old { // the parent (smaller pid, usually) that forked its children
			out[inode] = pid
		}
	}
	return out
}

// String lists the processes, for the report.
func (p Process) String() string {
	tree := ""
	if p.Tree {
		tree = " and its children"
	}
	return fmt.Sprintf("%s (pid %d%s)", p.Name, p.PID, tree)
}
