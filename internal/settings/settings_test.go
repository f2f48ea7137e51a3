package settings

import (
	"bytes"
	"flag"
	"io"
	"strings"
	"testing"
	"time"
)

// try binds s to a fresh flag set, parses args and returns the value and the
// binder's errors.
func try[T any](t *testing.T, s Setting[T], args ...string) (T, []*Error) {
	t.Helper()
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	b := NewBinder(fs)
	var v T
	s.Bind(b, &v)
	if err := fs.Parse(args); err != nil {
		t.Fatalf("parse %q: %v", args, err)
	}
	return v, b.Errors()
}

// zeroCase is what a setting does with an explicit 0, given as its flag and
// as its variable: it keeps a meaningful zero (want) or rejects it with a
// message naming the flag and the variable (reject).
type zeroCase struct {
	flag, env string
	check     func(t *testing.T, via string, args []string) (got string, errs []*Error)
	want      string // the value kept, as %v prints it, when 0 is honoured
	reject    string // part of the message when it is not
}

func zeroOf[T any](s Setting[T], want, reject string) zeroCase {
	return zeroCase{flag: s.Flag, env: s.Env, want: want, reject: reject,
		check: func(t *testing.T, via string, args []string) (string, []*Error) {
			v, errs := try(t, s, args...)
			return format(v), errs
		}}
}

func TestExplicitZeroIsHonouredOrRejectedNeverDefaulted(t *testing.T) {
	cases := []zeroCase{
		zeroOf(BatchSize, "", "0 is out of range 1..10000"),
		zeroOf(BatchWait, "-1ns", ""), // no wait: runtime.Config's negative BatchWait
		zeroOf(MaxRecordBytes, "", "must be positive"),
		zeroOf(RetryAttempts, "", "must be at least 1"),
		zeroOf(RetryInitial, "", "must be positive"),
		zeroOf(RetryMax, "", "must be positive"),
		zeroOf(HandlerTimeout, "", "must be positive"),
		zeroOf(StatementTimeout, "", "0s is too short"),
		zeroOf(LeaseTTL, "", "must be positive"),
		zeroOf(LeaseRenew, "", "must be positive"),
		zeroOf(EventDedup, "", "must be positive"),
		zeroOf(EventRetention, "", "must be positive"),
		zeroOf(InboxRetention, "", "0s is too short"),
		zeroOf(DeadLetterRetention, "-1ns", ""), // keep: runtime.Config's negative DeadLetterRetention
		zeroOf(NoRelay, "false", ""),
	}
	for _, tc := range cases {
		for _, via := range []string{"flag", "env"} {
			t.Run(tc.flag+"/"+via, func(t *testing.T) {
				var args []string
				if via == "flag" {
					args = []string{"--" + tc.flag + "=0"}
				} else {
					t.Setenv(tc.env, "0")
				}
				got, errs := tc.check(t, via, args)
				if tc.reject == "" {
					if len(errs) > 0 || got != tc.want {
						t.Errorf("0 gave %q, errors %v; want %q kept", got, errs, tc.want)
					}
					return
				}
				if len(errs) != 1 {
					t.Fatalf("0 gave %q, errors %v; want one error", got, errs)
				}
				want := "--" + tc.flag + " (" + tc.env + "): " + tc.reject
				if msg := errs[0].Error(); !strings.Contains(msg, want) {
					t.Errorf("error %q does not contain %q", msg, want)
				}
			})
		}
	}
}

func TestUnsetSettingsTakeTheirDefaults(t *testing.T) {
	if v, errs := try(t, BatchSize); v != DefaultBatchSize || errs != nil {
		t.Errorf("batch size %d, %v", v, errs)
	}
	if v, errs := try(t, BatchWait); v != DefaultBatchWait || errs != nil {
		t.Errorf("batch wait %s, %v", v, errs)
	}
	t.Setenv("KFN_LEASE_BUCKET", "") // an empty variable is unset
	if v, errs := try(t, LeaseBucket); v != "kfn_leases" || errs != nil {
		t.Errorf("lease bucket %q, %v", v, errs)
	}
	if _, errs := try(t, LeaseBucket, "--lease-bucket="); len(errs) != 1 || !strings.Contains(errs[0].Error(), "must not be empty") {
		t.Errorf("an empty --lease-bucket: %v; want it rejected", errs)
	}
}

func TestDeadLetterRetentionDefaultsTo30DaysAndRefusesANegativeOne(t *testing.T) {
	if v, errs := try(t, DeadLetterRetention); v != 30*24*time.Hour || errs != nil {
		t.Errorf("default: %s, %v", v, errs)
	}
	t.Setenv("KFN_DEAD_LETTER_RETENTION", "168h")
	if v, errs := try(t, DeadLetterRetention); v != 168*time.Hour || errs != nil {
		t.Errorf("KFN_DEAD_LETTER_RETENTION=168h: %s, %v", v, errs)
	}
	_, errs := try(t, DeadLetterRetention, "--dead-letter-retention", "-1h")
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), "--dead-letter-retention (KFN_DEAD_LETTER_RETENTION): must not be negative (0: keep dead letters") {
		t.Errorf("--dead-letter-retention -1h: %v; want it rejected", errs)
	}
}

func TestBooleanVariablesParseLikeStrconvParseBool(t *testing.T) {
	for text, want := range map[string]bool{"1": true, "t": true, "T": true, "true": true, "TRUE": true, "True": true,
		"0": false, "f": false, "F": false, "false": false, "FALSE": false, "False": false, " true ": true} {
		t.Setenv("KFN_NO_RELAY", text)
		if got, errs := try(t, NoRelay); got != want || errs != nil {
			t.Errorf("KFN_NO_RELAY=%q: %v, %v; want %v", text, got, errs, want)
		}
	}
	for _, text := range []string{"yes", "on", "2", "enabled"} {
		t.Setenv("KFN_NO_RELAY", text)
		got, errs := try(t, NoRelay)
		if got || len(errs) != 1 || !strings.Contains(errs[0].Error(), `--no-relay (KFN_NO_RELAY): "`+text+`" is not a boolean`) {
			t.Errorf("KFN_NO_RELAY=%q: %v, %v; want an error naming the flag and the variable", text, got, errs)
		}
	}
	t.Setenv("KFN_NO_RELAY", "true")
	if got, errs := try(t, NoRelay, "--no-relay=false"); got || errs != nil {
		t.Errorf("--no-relay=false over KFN_NO_RELAY=true: %v, %v", got, errs)
	}
	t.Setenv("KFN_NO_RELAY", "")
	if got, _ := try(t, NoRelay, "--no-relay"); !got {
		t.Error("--no-relay without a value is not true")
	}
}

func TestAFlagOverridesABadVariable(t *testing.T) {
	t.Setenv("KFN_BATCH_SIZE", "lots")
	if v, errs := try(t, BatchSize); v != DefaultBatchSize || len(errs) != 1 || errs[0].Error() != `invalid configuration: --batch-size (KFN_BATCH_SIZE): "lots" is not a whole number` {
		t.Errorf("KFN_BATCH_SIZE=lots: %d, %v", v, errs)
	}
	if v, errs := try(t, BatchSize, "--batch-size", "7"); v != 7 || errs != nil {
		t.Errorf("--batch-size 7 over KFN_BATCH_SIZE=lots: %d, %v", v, errs)
	}
}

func TestTheFormerVariableIsReadAndNamed(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	t.Setenv("KFN_DATABASE_URL", "postgres://u@h/d")
	if v, errs := try(t, DatabaseURL); v != "postgres://u@h/d" || errs != nil {
		t.Errorf("KFN_DATABASE_URL: %q, %v", v, errs)
	}
	t.Setenv("KFN_DATABASE_URL", "mysql://u:secret@h/d")
	_, errs := try(t, DatabaseURL)
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), `--database-url (KFN_DATABASE_URL): "mysql://u:xxxxx@h/d" is not a postgres:// URL`) {
		t.Errorf("a bad KFN_DATABASE_URL: %v; want it named, the password hidden", errs)
	}
}

func TestBrokersAreCheckedOneByOne(t *testing.T) {
	v, errs := try(t, KafkaBrokers, "--kafka-brokers", " a:9092, [::1]:9093 ,kafka,b:0,")
	if len(errs) != 2 || !strings.Contains(errs[0].Msg, `"kafka" is not host:port`) || !strings.Contains(errs[1].Msg, `"b:0" is not host:port`) {
		t.Errorf("errors %v; want kafka and b:0 named", errs)
	}
	if v != nil {
		t.Errorf("brokers %q kept despite the errors", v)
	}
	if v, errs := try(t, KafkaBrokers, "--kafka-brokers", "a:9092,[::1]:9093"); len(v) != 2 || errs != nil {
		t.Errorf("good brokers: %q, %v", v, errs)
	}
}

// Each flag's entry in -h shows its default once, and its variable.
func TestPrintDefaultsShowsEachDefaultOnce(t *testing.T) {
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	var out bytes.Buffer
	fs.SetOutput(&out)
	b := NewBinder(fs)
	var (
		n          int
		d, s       time.Duration
		str, plain string
		list       []string
		on         bool
	)
	BatchSize.Bind(b, &n)
	BatchWait.Bind(b, &d)
	StatementTimeout.Bind(b, &s)
	LeaseBucket.Bind(b, &str)
	KafkaBrokers.Bind(b, &list)
	NoRelay.Bind(b, &on)
	fs.StringVar(&plain, "function", "", "only this function (default: all)")
	fs.Int("limit", 100, "at most this many")
	PrintDefaults(fs)
	entries := flagEntries(out.String())
	want := map[string]string{
		"batch-size":        "  -batch-size int\n    \tmax records per transaction [KFN_BATCH_SIZE] (default 500)",
		"batch-wait":        "(default 20ms)",
		"statement-timeout": "(default 0.4 × --lease-ttl, at most 0.8 × --handler-timeout)",
		"lease-bucket":      `[KFN_LEASE_BUCKET] (default "kfn_leases")`,
		"kafka-brokers":     "  -kafka-brokers list\n",
		"no-relay":          "  -no-relay\n",
		"function":          "(default: all)",
		"limit":             "(default 100)",
	}
	for name, part := range want {
		e, ok := entries[name]
		if !ok {
			t.Errorf("no entry for -%s in:\n%s", name, out.String())
			continue
		}
		if !strings.Contains(e, part) {
			t.Errorf("-%s entry %q lacks %q", name, e, part)
		}
		if n := strings.Count(e, "default"); n > 1 {
			t.Errorf("-%s entry says default %d times: %q", name, n, e)
		}
	}
	for _, name := range []string{"kafka-brokers", "no-relay"} {
		if strings.Contains(entries[name], "default") {
			t.Errorf("-%s has no default but shows one: %q", name, entries[name])
		}
	}
}

func TestDurationsShowWithoutZeroUnits(t *testing.T) {
	for d, want := range map[time.Duration]string{2 * time.Minute: "2m", 168 * time.Hour: "168h", 90 * time.Minute: "1h30m",
		time.Hour + 5*time.Second: "1h0m5s", 20 * time.Millisecond: "20ms", 0: "0s"} {
		if got := formatDuration(d); got != want {
			t.Errorf("formatDuration(%s) = %q, want %q", d, got, want)
		}
	}
}

// flagEntries splits PrintDefaults output into each flag's lines.
func flagEntries(out string) map[string]string {
	entries := map[string]string{}
	name := ""
	for _, line := range strings.SplitAfter(out, "\n") {
		if rest, ok := strings.CutPrefix(line, "  -"); ok {
			name, _, _ = strings.Cut(strings.TrimSpace(rest), " ")
			name, _, _ = strings.Cut(name, "\t")
		}
		entries[name] += line
	}
	return entries
}
