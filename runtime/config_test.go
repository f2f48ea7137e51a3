package runtime_test

import (
	"context"
	"errors"
	"flag"
	"github.com/kfn-dev/kfn/internal/engine"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime"
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
		{"handler timeout below a round trip", func(c *runtime.Config) { c.HandlerTimeout = time.Second; c.StatementTimeout = time.Second }, "--handler-timeout", "lower --statement-timeout to at most 800ms"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := validConfig()
			if tc.name == "lease ttl too short" {
				cfg = cfg.WithDefaults()
			}
			tc.edit(&cfg)
			_, err := runtime.NewWorker(context.Background(), cfg, fn)
			var cfgErr *engine.ConfigError
			if !errors.As(err, &cfgErr) {
				t.Fatalf("err = %v, want a *engine.ConfigError", err)
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
		w, err := runtime.NewWorker(context.Background(), cfg, effects.Function("cfg", "topic"))
		var cfgErr *engine.ConfigError
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
	}
	for name, edit := range cases {
		t.Run(name, func(t *testing.T) {
			fn := good
			edit(&fn)
			if _, err := runtime.NewWorker(context.Background(), validConfig(), fn); err == nil || !strings.Contains(err.Error(), "function") {
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
	_, err := runtime.NewWorker(context.Background(), cfg, effects.Function("fn", "topic"))
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
		if code := runtime.Main(fn, args, io.Discard); code != 2 {
			t.Errorf("Main(%q) = %d, want 2", args, code)
		}
	}
}
