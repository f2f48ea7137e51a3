package bench

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	goruntime "runtime"
	"strings"
)

// Machine is where a benchmark ran, for its report: figures from two
// machines compare only with this beside them.
type Machine struct {
	CPU      string // model name, from /proc/cpuinfo
	CPUs     int    // logical CPUs this process may use
	Memory   int64  // bytes, MemTotal of /proc/meminfo
	OS       string // PRETTY_NAME of /etc/os-release
	Kernel   string
	Load     string // load average over 1, 5 and 15 minutes, when asked
	Go       string
	Hostname string
}

// DescribeMachine reads this machine's description; a field it cannot read
// is "unknown".
func DescribeMachine() Machine {
	m := Machine{CPU: "unknown", CPUs: goruntime.NumCPU(), OS: "unknown", Kernel: "unknown", Load: "unknown", Go: goruntime.Version()}
	if data, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		if v := field(data, "model name", ':'); v != "" {
			m.CPU = v
		}
	}
	m.Memory = kBFields("/proc/meminfo")["MemTotal"]
	if data, err := os.ReadFile("/etc/os-release"); err == nil {
		if v := strings.Trim(field(data, "PRETTY_NAME", '='), `"`); v != "" {
			m.OS = v
		}
	}
	if data, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = "Linux " + strings.TrimSpace(string(data))
	}
	if data, err := os.ReadFile("/proc/loadavg"); err == nil {
		if f := strings.Fields(string(data)); len(f) >= 3 {
			m.Load = strings.Join(f[:3], " ")
		}
	}
	m.Hostname, _ = os.Hostname()
	return m
}

// Class names the kind of machine in a report's file name: its CPUs and
// memory ("2cpu-24gib").
func (m Machine) Class() string {
	return fmt.Sprintf("%dcpu-%dgib", m.CPUs, (m.Memory+1<<29)>>30)
}

func (m Machine) String() string {
	return fmt.Sprintf("%s, %d CPUs, %.1f GiB memory; %s, %s; %s; load average %s at start",
		m.CPU, m.CPUs, float64(m.Memory)/(1<<30), m.OS, m.Kernel, m.Go, m.Load)
}

// field is the value of the first "name<sep>value" line of data.
func field(data []byte, name string, sep byte) string {
	for _, line := range bytes.Split(data, []byte("\n")) {
		k, v, ok := bytes.Cut(line, []byte{sep})
		if ok && string(bytes.TrimSpace(k)) == name {
			return string(bytes.TrimSpace(v))
		}
	}
	return ""
}

// kafkaJar is the version in the name of Apache Kafka's server jar.
var kafkaJar = regexp.MustCompile(`^kafka_[0-9.]+-([0-9][^-]*)\.jar$`)

// KafkaVersion is the version of the Apache Kafka broker that process pid
// runs, from the kafka_<scala>-<version>.jar on its class path (a
// directory/* entry is listed); "" if it cannot tell.
func KafkaVersion(pid int) string {
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return ""
	}
	args := strings.Split(string(cmdline), "\x00")
	for i, a := range args {
		if (a != "-cp" && a != "-classpath") || i+1 == len(args) {
			continue
		}
		for _, entry := range filepath.SplitList(args[i+1]) {
			if !filepath.IsAbs(entry) {
				entry = filepath.Join(fmt.Sprintf("/proc/%d/cwd", pid), entry)
			}
			jars := []string{entry}
			if strings.HasSuffix(entry, "*") {
				jars, _ = filepath.Glob(entry + ".jar")
			}
			for _, jar := range jars {
				if m := kafkaJar.FindStringSubmatch(filepath.Base(jar)); m != nil {
					return m[1]
				}
			}
		}
	}
	return ""
}
