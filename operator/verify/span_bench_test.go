package verify_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/operator/verify"
)

// BenchmarkVerifyRange checks 200,000 seeded records (4 partitions of
// 50,000) whole, then a range of 10,000 of them (partition 3, offsets
// [20000, 30000)), in one run, each with one effect row per record and
// with the inbox as the evidence. It logs each run's time and CPU per
// 10,000 records checked: the test process's (the check and the embedded
// Kafka broker) and the test database's Postgres backends'. The figures
// are in testdata/verify-bench.txt. Run it with
//
//	go test -run '^$' -bench BenchmarkVerifyRange -benchtime 3x ./operator/verify
func BenchmarkVerifyRange(b *testing.B) {
	const n = 200_000
	s := seed(b, n)
	for _, tc := range []struct {
		name    string
		sql     string
		ranged  bool
		records int64
	}{
		{"whole/per-record", perRecord, false, n},
		{"range-10k/per-record", perRecord, true, 10_000},
		{"whole/inbox", "", false, n},
		{"range-10k/inbox", "", true, 10_000},
		{"whole/per-record-indexed", perRecord, false, n},
		{"range-10k/per-record-indexed", perRecord, true, 10_000},
	} {
		if tc.name == "whole/per-record-indexed" {
			for _, sql := range []string{`CREATE INDEX ON effects (source_topic, source_partition, source_offset)`, `VACUUM ANALYZE effects`} {
				if _, err := s.db.Pool.Exec(context.Background(), sql); err != nil {
					b.Fatal(err)
				}
			}
		}
		b.Run(tc.name, func(b *testing.B) {
			spec := s.spec
			spec.EffectsSQL = tc.sql
			if tc.ranged {
				spec.Partitions, spec.From, spec.To = []int32{3}, verify.OffsetBound(20_000), verify.OffsetBound(30_000)
			}
			for b.Loop() {
				cpu, pg := cpuTime(b), backendsCPU(b, s)
				rep, err := verify.Run(context.Background(), s.db.Pool, nil, spec)
				if err != nil {
					b.Fatal(err)
				}
				cpu, pgUsed := cpuTime(b)-cpu, backendsCPU(b, s).since(pg)
				if !rep.OK || rep.Checked.Records != tc.records {
					b.Fatalf("ok %v, checked %+v, violations %+v; want %d records, no violation", rep.OK, rep.Checked, rep.Violations, tc.records)
				}
				per10k := 10_000 / float64(rep.Checked.Records)
				b.Logf("%d records checked in %.3fs; CPU per 10k records: %.3fs in the test process, %.3fs in Postgres",
					rep.Checked.Records, rep.Seconds, cpu.Seconds()*per10k, pgUsed.Seconds()*per10k)
			}
		})
	}
}

// backendCPU is the CPU time each Postgres backend of a test database has
// used, by process id.
type backendCPU map[int]time.Duration

// backendsCPU reads the CPU time of the test database's backends from
// /proc (the throwaway cluster runs on this machine).
func backendsCPU(tb testing.TB, s *seeded) backendCPU {
	tb.Helper()
	rows, err := s.db.Pool.Query(context.Background(), `SELECT pid FROM pg_stat_activity WHERE datname = current_database()`)
	if err != nil {
		tb.Fatal(err)
	}
	defer rows.Close()
	out := backendCPU{}
	for rows.Next() {
		var pid int
		if err := rows.Scan(&pid); err != nil {
			tb.Fatal(err)
		}
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			tb.Fatalf("read the CPU time of backend %d: %v (is Postgres on another machine?)", pid, err)
		}
		// utime and stime are fields 14 and 15, after the command's ")".
		fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
		utime, err1 := strconv.ParseInt(fields[11], 10, 64)
		stime, err2 := strconv.ParseInt(fields[12], 10, 64)
		if err1 != nil || err2 != nil {
			tb.Fatalf("read the CPU time of backend %d from %q", pid, stat)
		}
		out[pid] = time.Duration(utime+stime) * (time.Second / 100) // USER_HZ
	}
	return out
}

// since is the CPU time the backends used since before (a backend started
// since counts whole).
func (after backendCPU) since(before backendCPU) time.Duration {
	var d time.Duration
	for pid, t := range after {
		d += t - before[pid]
	}
	return d
}
