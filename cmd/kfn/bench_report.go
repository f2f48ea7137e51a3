package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/cmd/kfn/internal/bench"
	"github.com/kfn-dev/kfn/internal/redact"
)

// benchReport is kfn bench's report: everything the run prints on stdout,
// kept to be written, once the run is over, to a file of its own in
// --report-dir: <start time, UTC>-<machine class>.txt.
type benchReport struct {
	path string       // "" without --report-dir: nothing is written
	buf  bytes.Buffer // what stdout got
}

// newBenchReport checks that dir can take the report before the run
// spends its minutes; dir "" writes none.
func newBenchReport(dir string, started time.Time, m bench.Machine) (*benchReport, error) {
	r := &benchReport{}
	if dir == "" {
		return r, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, &usageError{msg: fmt.Sprintf("--report-dir %s: %v (give --report-dir '' to write no report)", dir, err)}
	}
	probe, err := os.CreateTemp(dir, ".kfn-bench-*")
	if err != nil {
		return nil, &usageError{msg: fmt.Sprintf("--report-dir %s: %v (give --report-dir '' to write no report)", dir, err)}
	}
	probe.Close()
	os.Remove(probe.Name())
	r.path = filepath.Join(dir, started.UTC().Format("20060102T150405Z")+"-"+m.Class()+".txt")
	return r, nil
}

// tee is where the run prints: stdout, and the report.
func (r *benchReport) tee(stdout io.Writer) io.Writer {
	if r.path == "" {
		return stdout
	}
	return io.MultiWriter(stdout, &r.buf)
}

// write writes the report and says where, on stdout.
func (r *benchReport) write(stdout io.Writer) error {
	if r.path == "" {
		return nil
	}
	if err := os.WriteFile(r.path, r.buf.Bytes(), 0o644); err != nil {
		return fmt.Errorf("write the report (--report-dir): %w", err)
	}
	fmt.Fprintf(stdout, "\nreport: %s\n", r.path)
	return nil
}

// benchCommand is the command line as given, with the values of secret
// settings redacted, and the settings that came from variables.
func benchCommand(fs *flagSet, args []string) (command string, env []string) {
	words := []string{"kfn", "bench"}
	secretNext := false
	for _, a := range args {
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		switch {
		case secretNext:
			a = redact.Redact(a)
			secretNext = false
		case strings.HasPrefix(a, "-") && hasValue && fs.settings.Secret(name):
			a = a[:len(a)-len(value)] + redact.Redact(value)
		case strings.HasPrefix(a, "-") && fs.settings.Secret(name):
			secretNext = true
		}
		words = append(words, shellWord(a))
	}
	for _, e := range fs.settings.Environment() {
		env = append(env, shellWord(e))
	}
	return strings.Join(words, " "), env
}

// shellWord quotes s for a POSIX shell when it needs it.
func shellWord(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=.,:/@+%") == "" {
		return s
	}
	return shellQuote(s)
}

// printBenchHeader prints what the figures depend on: the command, the
// machine and when the run started.
func printBenchHeader(w io.Writer, command string, env []string, m bench.Machine, started time.Time) {
	fmt.Fprintf(w, "kfn bench, started %s\n", started.UTC().Format(time.RFC3339))
	fmt.Fprintf(w, "command: %s\n", command)
	if len(env) > 0 {
		fmt.Fprintf(w, "settings from the environment: %s\n", strings.Join(env, " "))
	}
	fmt.Fprintf(w, "machine: %s\n", m)
}

// serviceVersions names the versions of Postgres, NATS and Kafka the run
// uses.
func serviceVersions(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, st *stack, procs []bench.Process) string {
	pg := "unknown"
	if err := pool.QueryRow(ctx, "SHOW server_version").Scan(&pg); err != nil {
		pg = "unknown (" + redact.Scrub(err.Error(), st.DatabaseURL) + ")"
	}
	kafka := "not on this machine, version unknown"
	switch {
	case bench.InThisProcess(st.Brokers):
		kafka = "embedded broker (franz-go kfake " + moduleVersion("github.com/twmb/franz-go/pkg/kfake") + ")"
	default:
		for _, p := range procs {
			if p.Name != "kafka" {
				continue
			}
			if v := bench.KafkaVersion(p.PID); v != "" {
				kafka = "Apache Kafka " + v
			} else {
				kafka = fmt.Sprintf("a process on this machine (pid %d) without a kafka_<scala>-<version>.jar on its class path", p.PID)
			}
		}
	}
	return fmt.Sprintf("Postgres %s, NATS %s, Kafka: %s", pg, js.Conn().ConnectedServerVersion(), kafka)
}

// moduleVersion is the version of module path in this binary.
func moduleVersion(path string) string {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, d := range info.Deps {
			if d.Path == path {
				return d.Version
			}
		}
	}
	return "unknown"
}

// printBenchLatency prints each mode's commit latency and memory.
func printBenchLatency(w io.Writer, results []bench.Result) {
	fmt.Fprintln(w, "\ncommit latency, per record: from its transaction's BEGIN (its batch fetched and in the lane's hands) to the COMMIT's reply;"+
		" a record has its batch's (naive: its own transaction; chain: both functions' batches)")
	fmt.Fprintln(w, "memory: the peak RSS of kfn bench during the mode (VmHWM, restarted at each mode);"+
		" Postgres: what its processes hold at the mode's end, their private memory summed and the shared buffers once (- : not on this machine)")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MODE\tCOMMIT-P50\tCOMMIT-P99\tTRANSACTIONS\tPEAK-RSS\tPOSTGRES-MEMORY")
	for _, r := range results {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", r.Mode, r.Commit.P50.Round(10*time.Microsecond), r.Commit.P99.Round(10*time.Microsecond),
			r.Commit.Transactions, bench.MiB(r.PeakRSS), bench.MiB(r.PostgresMemory))
	}
	tw.Flush()
}
