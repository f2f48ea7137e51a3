package runtime_test

import (
	"context"
	"errors"
	"flag"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/internal/preflight"
	"github.com/kfn-dev/kfn/internal/process"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

func validConfig() runtime.Config {
	return runtime.Config{
		KafkaBrokers: []string{"127.0.0.1:9092"},
		DatabaseURL:  "postgres://postgres@127.0.0.1:5432/postgres",
		NATSURL:      "nats://127.0.0.1:4222",
	}
}

func TestBadConfigurationNamesTheField(t *testing.T) {
	fn := effects.Function("cfg", "topic")
	cases := []struct {
		name  string
		edit  func(*runtime.Config)
		field string
		hint  string
	}{
		{"no brokers", func(c *runtime.Config) { c.KafkaBrokers = nil }, "--kafka-brokers (KFN_KAFKA_BROKERS)", "host:port"},
		{"broker without port", func(c *runtime.Config) { c.KafkaBrokers = []string{"kafka"} }, "--kafka-brokers", `"kafka" is not host:port`},
		{"no database", func(c *runtime.Config) { c.DatabaseURL = "" }, "--database-url (DATABASE_URL)", "postgres://"},
		{"not a postgres URL", func(c *runtime.Config) { c.DatabaseURL = "mysql://x@y/z" }, "--database-url", "not a postgres:// URL"},
		{"no NATS", func(c *runtime.Config) { c.NATSURL = "" }, "--nats-url (KFN_NATS_URL)", "nats://"},
		{"batch too big", func(c *runtime.Config) { c.BatchSize = 1_000_000 }, "--batch-size", "out of range"},
		{"start-from", func(c *runtime.Config) { c.StartFrom = "middle" }, "--start-from", "neither earliest nor latest"},
		{"lease ttl too short", func(c *runtime.Config) { c.LeaseTTL = c.LeaseRenew }, "--lease-ttl", "3 × --lease-renew"},
		{"retry max below initial", func(c *runtime.Config) { c.RetryInitial = 2e9; c.RetryMax = 1e9 }, "--retry-max", "at least --retry-initial"},
		{"statement timeout past the lease", func(c *runtime.Config) { c.StatementTimeout = 3 * time.Second }, "--statement-timeout", "raise --lease-ttl to at least 5.357s"},
		{"NATS CA file unreadable", func(c *runtime.Config) { c.NATSSecurity.CAFile = "/nonexistent/ca.pem" }, "--nats-ca (KFN_NATS_CA)", "cannot read the CA file"},
		{"NATS cert without key", func(c *runtime.Config) { c.NATSSecurity.CertFile = "/etc/hostname" }, "--nats-key (KFN_NATS_KEY)", "without its private key"},
		{"NATS creds and token", func(c *runtime.Config) { c.NATSSecurity.Creds, c.NATSSecurity.TokenFile = "a.creds", "token" }, "--nats-token-file (KFN_NATS_TOKEN_FILE)", "give only one of"},
		{"unknown outbox mode", func(c *runtime.Config) { c.Outbox = "disk" }, "--outbox (KFN_OUTBOX)", "use table or wal"},
		{"handler timeout below a round trip", func(c *runtime.Config) { c.HandlerTimeout = time.Second; c.StatementTimeout = time.Second }, "--handler-timeout", "lower --statement-timeout to at most 800ms"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := validConfig()
			if tc.name == "lease ttl too short" {
				cfg = cfg.WithDefaults()
			}
			tc.edit(&cfg)
			_, err := worker.New(context.Background(), cfg, fn)
			var cfgErr *preflight.ConfigError
			if !errors.As(err, &cfgErr) {
				t.Fatalf("err = %v, want a *preflight.ConfigError", err)
			}
			if !strings.Contains(err.Error(), tc.field) || !strings.Contains(err.Error(), tc.hint) {
				t.Errorf("error %q should name %q and say %q", err, tc.field, tc.hint)
			}
		})
	}
}

// The statement timeout follows the lease TTL and the handler timeout
// unless it is set, and the defaults never contradict each other.
func TestStatementTimeoutDefaultsFitTheLease(t *testing.T) {
	for _, tc := range []struct {
		ttl, handler, want time.Duration
	}{
		{0, 0, 2 * time.Second},                                      // 0.4 × 5s
		{2 * time.Second, 0, 800 * time.Millisecond},                 // 0.4 × 2s
		{30 * time.Second, 2 * time.Second, 1600 * time.Millisecond}, // 0.8 × the handler timeout
	} {
		cfg := validConfig()
		cfg.LeaseTTL, cfg.HandlerTimeout = tc.ttl, tc.handler
		if tc.ttl != 0 {
			cfg.LeaseRenew = tc.ttl / 5
		}
		if got := cfg.WithDefaults().StatementTimeout; got != tc.want {
			t.Errorf("lease TTL %v, handler timeout %v: statement timeout %v, want %v", tc.ttl, tc.handler, got, tc.want)
		}
		w, err := worker.New(context.Background(), cfg, effects.Function("cfg", "topic"))
		var cfgErr *preflight.ConfigError
		if errors.As(err, &cfgErr) {
			t.Errorf("lease TTL %v, handler timeout %v: defaults rejected: %v", tc.ttl, tc.handler, err)
		}
		if w != nil {
			w.Close()
		}
	}
}

func TestBadFunctionDefinitionIsRejected(t *testing.T) {
	good := effects.Function("fn", "topic")
	cases := map[string]func(*runtime.Function){
		"no name":       func(f *runtime.Function) { f.Name = "" },
		"bad name":      func(f *runtime.Function) { f.Name = "a b" },
		"no topic":      func(f *runtime.Function) { f.Topic = "" },
		"no handler":    func(f *runtime.Function) { f.Handler = nil },
		"both handlers": func(f *runtime.Function) { f.BatchHandler = effects.BatchFunction("fn", "topic").BatchHandler },
		"PipelineExecs with a BatchHandler": func(f *runtime.Function) {
			f.Handler, f.BatchHandler, f.PipelineExecs = nil, effects.BatchFunction("fn", "topic").BatchHandler, true
		},
	}
	for name, edit := range cases {
		t.Run(name, func(t *testing.T) {
			fn := good
			edit(&fn)
			if _, err := worker.New(context.Background(), validConfig(), fn); err == nil || !strings.Contains(err.Error(), "function") {
				t.Errorf("err = %v, want an error about the function definition", err)
			}
		})
	}
}

func TestEnvironmentValuesThatDoNotParseAreReported(t *testing.T) {
	t.Setenv("KFN_BATCH_SIZE", "lots")
	t.Setenv("KFN_LEASE_TTL", "5")
	var cfg runtime.Config
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	cfg.Bind(fs)
	if err := fs.Parse([]string{"--kafka-brokers", "127.0.0.1:9092", "--database-url", "postgres://u@h:5432/d", "--nats-url", "nats://h:4222"}); err != nil {
		t.Fatal(err)
	}
	_, err := worker.New(context.Background(), cfg, effects.Function("fn", "topic"))
	if err == nil {
		t.Fatal("want an error")
	}
	for _, want := range []string{`--batch-size (KFN_BATCH_SIZE): "lots" is not a whole number`, `--lease-ttl (KFN_LEASE_TTL): "5" is not a duration`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not contain %q", err, want)
		}
	}
}

func TestFlagsOverrideTheEnvironment(t *testing.T) {
	t.Setenv("KFN_BATCH_SIZE", "7")
	t.Setenv("DATABASE_URL", "postgres://env@h:5432/d")
	var cfg runtime.Config
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	cfg.Bind(fs)
	if err := fs.Parse([]string{"--database-url", "postgres://flag@h:5432/d"}); err != nil {
		t.Fatal(err)
	}
	if cfg.BatchSize != 7 || cfg.DatabaseURL != "postgres://flag@h:5432/d" {
		t.Errorf("batch size %d (want 7 from env), database URL %q (want the flag's)", cfg.BatchSize, cfg.DatabaseURL)
	}
}

func TestMainRejectsUnknownFlagsAndArguments(t *testing.T) {
	fn := effects.Function("fn", "topic")
	for _, args := range [][]string{{"--no-such-flag"}, {"stray"}, {"--log-level", "loud"}, {"--batch-size", "x"}} {
		if code := worker.Main(fn, args, io.Discard); code != 2 {
			t.Errorf("Main(%q) = %d, want 2", args, code)
		}
	}
}

// The migrate mode (`orders migrate`) takes --database-url and nothing
// else; a mistake in how it is called exits 2 and says what is wrong.
func TestMainMigrateModeRejectsBadInvocations(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	fn := effects.Function("fn", "topic")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"migrate"}, "fn migrate: --database-url is required (or set DATABASE_URL)"},
		{[]string{"migrate", "--database-url", "postgres://x@127.0.0.1:1/d", "stray"}, `fn migrate: unexpected argument "stray"`},
		{[]string{"migrate", "--batch-size", "5"}, "fn migrate: unknown flag --batch-size (see fn migrate -h)"},
		{[]string{"migrate", "--database-url", "mysql://x@h/d"}, "fn migrate: invalid configuration: --database-url (DATABASE_URL):"},
		{[]string{"--database-url", "postgres://x@127.0.0.1:1/d", "migrate"}, "fn: migrate must come first: fn migrate --database-url …"},
	} {
		var stderr strings.Builder
		if code := worker.Main(fn, tc.args, &stderr); code != 2 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("Main(%q) = %d, stderr %q; want 2 and %q", tc.args, code, stderr.String(), tc.want)
		}
	}
	var help, stderr strings.Builder
	if code := process.Main(fn, []string{"migrate", "-h"}, &help, &stderr); code != 0 || !strings.Contains(help.String(), "-database-url") || strings.Contains(help.String(), "-batch-size") || stderr.Len() > 0 {
		t.Errorf("migrate -h: exit %d, stdout %q, stderr %q; want only --database-url listed, on stdout", code, help.String(), stderr.String())
	}
}

// bindConfig binds a Config to a fresh flag set and parses args.
func bindConfig(t *testing.T, args ...string) runtime.Config {
	t.Helper()
	var cfg runtime.Config
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	cfg.Bind(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// An explicit zero from a flag or the environment is checked, not taken
// for "unset": it is rejected naming the flag and the variable, or kept
// when it means something (--batch-wait 0: no wait).
func TestConfigExplicitZeroIsRejectedOrHonoured(t *testing.T) {
	fn := effects.Function("fn", "topic")
	for _, tc := range []struct {
		args []string
		env  string
		want string
	}{
		{args: []string{"--batch-size", "0"}, want: "--batch-size (KFN_BATCH_SIZE): 0 is out of range 1..10000"},
		{env: "KFN_BATCH_SIZE", want: "--batch-size (KFN_BATCH_SIZE): 0 is out of range 1..10000"},
		{args: []string{"--retry-attempts", "0"}, want: "--retry-attempts (KFN_RETRY_ATTEMPTS): must be at least 1"},
		{env: "KFN_RETRY_ATTEMPTS", want: "--retry-attempts (KFN_RETRY_ATTEMPTS): must be at least 1"},
		{args: []string{"--lease-ttl", "0s"}, want: "--lease-ttl (KFN_LEASE_TTL): must be positive"},
		{env: "KFN_HANDLER_TIMEOUT", want: "--handler-timeout (KFN_HANDLER_TIMEOUT): must be positive"},
		{args: []string{"--max-record-bytes", "0"}, want: "--max-record-bytes (KFN_MAX_RECORD_BYTES): must be positive"},
		{env: "KFN_NATS_REPLICAS", want: "--nats-replicas (KFN_NATS_REPLICAS): 0 is out of range 1..5"},
		{args: []string{"--nats-replicas", "7"}, want: "--nats-replicas (KFN_NATS_REPLICAS): 7 is out of range 1..5"},
	} {
		if tc.env != "" {
			t.Setenv(tc.env, "0")
		}
		cfg := bindConfig(t, append([]string{"--kafka-brokers", "127.0.0.1:9092", "--database-url", "postgres://u@h:5432/d", "--nats-url", "nats://h:4222"}, tc.args...)...)
		_, err := worker.New(context.Background(), cfg, fn)
		var cfgErr *preflight.ConfigError
		if !errors.As(err, &cfgErr) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q %s=0: err = %v; want a ConfigError saying %q", tc.args, tc.env, err, tc.want)
		}
		if tc.env != "" {
			t.Setenv(tc.env, "")
		}
	}

	for _, c := range []runtime.Config{bindConfig(t, "--batch-wait", "0"), func() runtime.Config { t.Setenv("KFN_BATCH_WAIT", "0"); return bindConfig(t) }()} {
		if c.BatchWait >= 0 || c.WithDefaults().BatchWait >= 0 {
			t.Errorf("batch wait 0 became %s (%s with defaults); want it kept as no wait (negative)", c.BatchWait, c.WithDefaults().BatchWait)
		}
		_, err := worker.New(context.Background(), c, fn) // no services given: only those are reported
		if err == nil || strings.Contains(err.Error(), "batch-wait") {
			t.Errorf("batch wait 0: err = %v; want it accepted", err)
		}
	}
	if got := (runtime.Config{}).WithDefaults(); got.BatchSize != settings.DefaultBatchSize || got.BatchWait != settings.DefaultBatchWait || got.RetryAttempts != settings.DefaultRetryAttempts || got.NATSReplicas != 1 {
		t.Errorf("a Go caller's zero fields: %+v; want the defaults", got)
	}
}

func TestEnvironmentBooleansParseLikeParseBool(t *testing.T) {
	for text, want := range map[string]bool{"1": true, "true": true, "TRUE": true, "0": false, "false": false, "F": false} {
		t.Setenv("KFN_NO_RELAY", text)
		if got := bindConfig(t).NoRelay; got != want {
			t.Errorf("KFN_NO_RELAY=%s: NoRelay %v, want %v", text, got, want)
		}
	}
	t.Setenv("KFN_NO_RELAY", "yes")
	_, err := worker.New(context.Background(), bindConfig(t), effects.Function("fn", "topic"))
	if err == nil || !strings.Contains(err.Error(), `--no-relay (KFN_NO_RELAY): "yes" is not a boolean`) {
		t.Errorf("KFN_NO_RELAY=yes: err = %v; want it named", err)
	}
}

// A function binary's -h lists every flag with its variable, and each
// default once.
func TestMainHelpShowsEachDefaultOnce(t *testing.T) {
	var out, stderr strings.Builder
	if code := process.Main(effects.Function("fn", "topic"), []string{"-h"}, &out, &stderr); code != 0 || stderr.Len() > 0 {
		t.Fatalf("-h: exit %d, stderr %q; want 0 and the help on stdout", code, stderr.String())
	}
	help := out.String()
	for _, line := range strings.Split(help, "\n") {
		if n := strings.Count(line, "default"); n > 1 {
			t.Errorf("%q says default %d times", line, n)
		}
	}
	for _, want := range []string{"[KFN_BATCH_SIZE] (default 500)", "[KFN_BATCH_WAIT] (default 20ms)", "[KFN_EVENT_RETENTION] (default 168h)",
		"[DATABASE_URL, or a file: DATABASE_URL_FILE]\n", "  -no-relay\n", "[KFN_LOG_LEVEL] (default \"info\")", "[KFN_METRICS_ADDR]\n", "(default host-pid)",
		"  -skip-setup\n", "fn migrate applies kfn's schema migrations and the function's Setup", "fn --version prints its version, commit and build time"} {
		if !strings.Contains(help, want) {
			t.Errorf("-h lacks %q:\n%s", want, help)
		}
	}
}

func TestMainRejectsAnExplicitZeroNamingFlagAndVariable(t *testing.T) {
	var out strings.Builder
	code := worker.Main(effects.Function("fn", "topic"), []string{"--batch-size", "0", "--no-relay=1"}, &out)
	if code != 2 || !strings.Contains(out.String(), "--batch-size (KFN_BATCH_SIZE): 0 is out of range 1..10000") || strings.Contains(out.String(), "no-relay") {
		t.Errorf("exit %d, stderr %q; want exit 2 naming --batch-size and KFN_BATCH_SIZE, and --no-relay=1 accepted", code, out.String())
	}
}

// A rejected value is reported once, as given, not also as missing.
func TestConfigRejectedValueIsNotAlsoMissing(t *testing.T) {
	cfg := bindConfig(t, "--kafka-brokers", "kafka", "--database-url", "mysql://u@h/d", "--nats-url", "nats://h:4222")
	_, err := worker.New(context.Background(), cfg, effects.Function("fn", "topic"))
	if err == nil || !strings.Contains(err.Error(), `"kafka" is not host:port`) || !strings.Contains(err.Error(), "not a postgres:// URL") ||
		strings.Contains(err.Error(), "no Kafka broker given") || strings.Contains(err.Error(), "no Postgres URL given") {
		t.Errorf("err = %v; want the given values named, not reported missing", err)
	}
}

// One consumer group cannot take the offsets of two Kafka functions.
func TestConsumerGroupIsRefusedForSeveralKafkaFunctions(t *testing.T) {
	cfg := validConfig()
	cfg.ConsumerGroup = "shared"
	_, err := worker.New(context.Background(), cfg, effects.Function("fa", "ta"), effects.Function("fb", "tb"))
	var cfgErr *preflight.ConfigError
	if !errors.As(err, &cfgErr) || !strings.Contains(err.Error(), "--consumer-group (KFN_CONSUMER_GROUP)") || !strings.Contains(err.Error(), "2 Kafka functions (fa, fb)") {
		t.Errorf("err = %v, want a ConfigError naming --consumer-group and both functions", err)
	}
}

// An OTEL_* value kfn cannot follow stops the worker before it connects,
// naming the variable.
func TestMainRejectsAnOTelVariableItCannotFollow(t *testing.T) {
	t.Setenv("OTEL_TRACES_EXPORTER", "zipkin")
	var out strings.Builder
	code := worker.Main(effects.Function("fn", "topic"), []string{"--kafka-brokers", "127.0.0.1:1", "--database-url", "postgres://u@127.0.0.1:1/d", "--nats-url", "nats://127.0.0.1:1"}, &out)
	if code != 2 || !strings.Contains(out.String(), `invalid configuration: OTEL_TRACES_EXPORTER: "zipkin": kfn exports traces with "otlp" or "console"`) {
		t.Errorf("exit %d, stderr %q; want exit 2 naming OTEL_TRACES_EXPORTER", code, out.String())
	}
}

// TestAWorkerInWALModeRefusesToStartWithoutTheSlot starts a worker whose
// function emits, with --outbox wal, on a database whose WAL outbox is not
// set up: it refuses, naming the setting and the command that sets it up.
func TestAWorkerInWALModeRefusesToStartWithoutTheSlot(t *testing.T) {
	db := kfntest.Postgres(t)
	cfg := runtime.Config{KafkaBrokers: kfntest.Kafka(t).Brokers, DatabaseURL: db.URL, NATSURL: kfntest.NATSURL(t), Outbox: "wal"}
	_, err := worker.New(context.Background(), cfg, effects.Function(kfntest.Name(t, "fn"), "topic"))
	if err == nil || !strings.Contains(err.Error(), "--outbox wal (KFN_OUTBOX)") || !strings.Contains(err.Error(), "kfn migrate --outbox wal") {
		t.Fatalf("worker.New with --outbox wal and no slot: %v", err)
	}
}

// TestMainRejectsAWSMSKIAMWhenItsModuleIsNotImported: a binary built without
// github.com/kfn-dev/kfn/kafkaauth/mskiam cannot log in with AWS_MSK_IAM,
// and says at start (exit 2) which module to import. Before the mechanism
// existed, the value itself was refused.
func TestMainRejectsAWSMSKIAMWhenItsModuleIsNotImported(t *testing.T) {
	var out strings.Builder
	code := worker.Main(effects.Function("fn", "topic"), []string{"--kafka-brokers", "127.0.0.1:1", "--database-url", "postgres://u@127.0.0.1:1/d", "--nats-url", "nats://127.0.0.1:1",
		"--kafka-tls", "--kafka-sasl-mechanism", "AWS_MSK_IAM"}, &out)
	// The error is the first line that is not a log record: the memory
	// limit's INFO line comes before it.
	var first string
	for line := range strings.Lines(out.String()) {
		if !strings.HasPrefix(line, "{") {
			first = strings.TrimSuffix(line, "\n")
			break
		}
	}
	want := "fn: invalid configuration: --kafka-sasl-mechanism (KFN_KAFKA_SASL_MECHANISM): AWS_MSK_IAM is not built into this binary: its main package must import github.com/kfn-dev/kfn/kafkaauth/mskiam"
	if code != 2 || !strings.HasPrefix(first, want) {
		t.Errorf("exit %d, first line that is not a log record %q; want exit 2 and %q", code, first, want)
	}
}

// TestMainAcceptsOAuthBearerSettings: OAUTHBEARER, once refused with exit
// 2, is a mechanism whose settings bind from flags and variables; a token
// endpoint without its client secret is the one problem reported.
func TestMainAcceptsOAuthBearerSettings(t *testing.T) {
	t.Setenv("KFN_KAFKA_OAUTH_CLIENT_ID", "kfn-fn")
	var out strings.Builder
	code := worker.Main(effects.Function("fn", "topic"), []string{"--kafka-brokers", "127.0.0.1:1", "--database-url", "postgres://u@127.0.0.1:1/d", "--nats-url", "nats://127.0.0.1:1",
		"--kafka-tls", "--kafka-sasl-mechanism", "OAUTHBEARER", "--kafka-oauth-token-url", "https://idp.example/token", "--kafka-oauth-scopes", "kafka,read"}, &out)
	first, _, _ := strings.Cut(out.String(), "\n")
	want := "fn: invalid configuration: --kafka-oauth-client-secret-file (KFN_KAFKA_OAUTH_CLIENT_SECRET or KFN_KAFKA_OAUTH_CLIENT_SECRET_FILE): --kafka-oauth-token-url needs the client secret of --kafka-oauth-client-id"
	if code != 2 || first != want+": set KFN_KAFKA_OAUTH_CLIENT_SECRET, or name a file holding it" {
		t.Errorf("exit %d, stderr %q; want exit 2 and %q", code, out.String(), want)
	}
}
