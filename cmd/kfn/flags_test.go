package main

import (
	"strings"
	"testing"
)

// Every command's -h shows each default once, and the shared settings with
// their variables.
func TestHelpShowsEachDefaultOnce(t *testing.T) {
	for _, args := range [][]string{{"dev"}, {"migrate"}, {"status"}, {"replay"}, {"dlq"}, {"dlq", "list"}, {"dlq", "show"}, {"dlq", "discard"}, {"dlq", "purge"}, {"dlq", "park"}, {"audit"}, {"bench"}, {"relay"}} {
		code, stderr, _ := kfn(t, append(args, "-h")...)
		if code != 0 {
			t.Errorf("kfn %s -h: exit %d", strings.Join(args, " "), code)
		}
		for _, line := range strings.Split(stderr, "\n") {
			if n := strings.Count(line, "default"); n > 1 {
				t.Errorf("kfn %s -h: %q says default %d times", strings.Join(args, " "), line, n)
			}
		}
		if !strings.Contains(stderr, "[DATABASE_URL, or a file: DATABASE_URL_FILE]") {
			t.Errorf("kfn %s -h does not name DATABASE_URL:\n%s", strings.Join(args, " "), stderr)
		}
	}
	_, help, _ := kfn(t, "bench", "-h")
	for _, want := range []string{"[KFN_BATCH_SIZE] (default 500)", "[KFN_BATCH_WAIT] (default 20ms)", "(default a throwaway cluster started here)", "(default: --records)"} {
		if !strings.Contains(help, want) {
			t.Errorf("kfn bench -h lacks %q:\n%s", want, help)
		}
	}
}

func TestRelayHelpListsOnlyTheRelaysFlags(t *testing.T) {
	code, help, _ := kfn(t, "relay", "-h")
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	for _, want := range []string{"-database-url", "-nats-url", "-subjects", "-lease-ttl", "-lease-renew", "-lease-bucket", "-event-stream", "-event-dedup", "-event-retention", "-statement-timeout", "-worker-id", "-stats-every", "-metrics-addr", "-nats-creds", "-nats-nkey", "-nats-ca", "-nats-cert", "-nats-key", "-nats-replicas", "-nats-provisioned", "(default kfn-relay-host-pid)"} {
		if !strings.Contains(help, want) {
			t.Errorf("kfn relay -h lacks %s", want)
		}
	}
	// Flags are listed as "  -name …" lines; the description and the
	// examples may mention a worker's flag (--no-relay, --log-level).
	for _, worker := range []string{"batch", "retry", "handler", "max-record-bytes", "start-from", "no-relay", "inbox-retention", "kafka-brokers", "stall-after"} {
		if strings.Contains(help, "\n  -"+worker) {
			t.Errorf("kfn relay -h lists the worker's -%s:\n%s", worker, help)
		}
	}
	if code, _, stderr := kfn(t, "relay", "--batch-size", "10"); code != 2 || !strings.Contains(stderr, "unknown flag --batch-size") {
		t.Errorf("kfn relay --batch-size: exit %d, %q; want it rejected", code, stderr)
	}
}

// An explicit zero for a shared setting is rejected naming the flag and the
// variable, never replaced by the default.
func TestCommandsRejectAnExplicitZero(t *testing.T) {
	relay := []string{"relay", "--database-url", "postgres://x@127.0.0.1:1/z", "--nats-url", "nats://127.0.0.1:1", "--subjects", "a.b"}
	for _, tc := range []struct {
		args []string
		env  string
		want string
	}{
		{args: []string{"bench", "--batch-size", "0"}, want: "--batch-size (KFN_BATCH_SIZE): 0 is out of range 1..10000"},
		{args: []string{"bench"}, env: "KFN_BATCH_SIZE", want: "--batch-size (KFN_BATCH_SIZE): 0 is out of range 1..10000"},
		{args: []string{"bench", "--relay-events", "0"}, want: "--relay-events and --relay-duration must be positive"},
		{args: []string{"bench", "--relay-rate", "-1"}, want: "--relay-rate -1: must be positive, or 0 for 50% and 80% of the maximum rate"},
		{args: []string{"bench", "--report-dir", "/proc/kfn-bench-reports"}, want: "--report-dir /proc/kfn-bench-reports: mkdir /proc/kfn-bench-reports: no such file or directory (give --report-dir '' to write no report)"},
		{args: []string{"bench", "--partitions", "0"}, want: "--partitions 0 is out of range 1..256"},
		{args: append(relay, "--lease-ttl", "0"), want: "--lease-ttl (KFN_LEASE_TTL): must be positive"},
		{args: relay, env: "KFN_LEASE_RENEW", want: "--lease-renew (KFN_LEASE_RENEW): must be positive"},
		{args: append(relay, "--event-retention", "0s"), want: "--event-retention (KFN_EVENT_RETENTION): must be positive"},
		{args: append(relay, "--statement-timeout", "0"), want: "--statement-timeout (KFN_STATEMENT_TIMEOUT): 0s is too short"},
		{args: append(relay, "--nats-replicas", "0"), want: "--nats-replicas (KFN_NATS_REPLICAS): 0 is out of range 1..5"},
		{args: []string{"migrate", "--database-url", "postgres://x@y/z", "--nats", "--nats-url", "nats://n"}, env: "KFN_NATS_REPLICAS", want: "--nats-replicas (KFN_NATS_REPLICAS): 0 is out of range 1..5"},
		{args: []string{"status", "--database-url", "postgres://x@y/z", "--kafka-brokers", "kafka"}, want: `--kafka-brokers (KFN_KAFKA_BROKERS): "kafka" is not host:port`},
		{args: []string{"migrate", "--database-url", "mysql://x@y/z"}, want: `--database-url (DATABASE_URL): "mysql://xxxxx@y/z" is not a postgres:// URL`},
		{args: []string{"migrate"}, env: "DATABASE_URL", want: `--database-url (DATABASE_URL): "0" is not a postgres:// URL`},
	} {
		if tc.env != "" {
			t.Setenv(tc.env, "0")
		}
		code, _, stderr := kfn(t, tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("kfn %q with %s=0: exit %d, stderr %q; want exit 2 and %q", tc.args, tc.env, code, stderr, tc.want)
		}
		if tc.env != "" {
			t.Setenv(tc.env, "")
		}
	}
}

func TestRelayReadsItsSubjectsFromTheEnvironment(t *testing.T) {
	t.Setenv("KFN_RELAY_SUBJECTS", "orders..accepted")
	code, _, stderr := kfn(t, "relay", "--database-url", "postgres://x@127.0.0.1:1/z", "--nats-url", "nats://127.0.0.1:1")
	if code != 2 || !strings.Contains(stderr, `--subjects (KFN_RELAY_SUBJECTS): "orders..accepted" is not a valid NATS subject`) {
		t.Errorf("exit %d, stderr %q; want the variable's subject checked", code, stderr)
	}
}
