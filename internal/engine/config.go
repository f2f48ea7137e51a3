package engine

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/lease"
)

// Config is how a worker connects and behaves. Every field can be set by a
// flag or an environment variable (see Bind); zero values take the defaults
// from WithDefaults.
type Config struct {
	KafkaBrokers   []string      // KFN_KAFKA_BROKERS: comma-separated host:port list
	DatabaseURL    string        // DATABASE_URL: Postgres connection URL
	NATSURL        string        // KFN_NATS_URL: NATS server URL
	WorkerID       string        // KFN_WORKER_ID: unique per process; default host-pid
	BatchSize      int           // KFN_BATCH_SIZE: max records per transaction
	BatchWait      time.Duration // KFN_BATCH_WAIT: max time to wait to fill a batch
	MaxRecordBytes int           // KFN_MAX_RECORD_BYTES: larger records (key, value and headers) are dead-lettered as oversized
	RetryAttempts  int           // KFN_RETRY_ATTEMPTS: handler tries per record before it is dead-lettered
	RetryInitial   time.Duration // KFN_RETRY_INITIAL: first backoff between handler tries
	RetryMax       time.Duration // KFN_RETRY_MAX: largest backoff between handler tries
	HandlerTimeout time.Duration // KFN_HANDLER_TIMEOUT: a handler call running longer is dead-lettered (reason timeout)

	// StatementTimeout (KFN_STATEMENT_TIMEOUT) is the longest a Postgres
	// statement of the worker may run: the sessions' statement_timeout. A
	// round trip not answered within 5/4 of it is taken for a frozen
	// connection, which the worker closes. Default: 0.4 × LeaseTTL, or
	// 0.8 × HandlerTimeout if that is less. See the package doc, "Timing".
	StatementTimeout time.Duration

	StartFrom      string        // KFN_START_FROM: earliest|latest, where a partition with no cursor starts
	LeaseTTL       time.Duration // KFN_LEASE_TTL: partition lease lifetime without renewal
	LeaseRenew     time.Duration // KFN_LEASE_RENEW: how often leases and heartbeats are renewed
	LeaseBucket    string        // KFN_LEASE_BUCKET: the NATS KV bucket of the leases; all workers of a function share it
	NoRelay        bool          // KFN_NO_RELAY: do not run the outbox relay in this process (run `kfn relay` instead)
	EventStream    string        // KFN_EVENT_STREAM: the JetStream stream outbox events are relayed to
	EventDedup     time.Duration // KFN_EVENT_DEDUP: the stream's duplicate window, when the relay creates it
	EventRetention time.Duration // KFN_EVENT_RETENTION: the event stream's max age, when the relay creates it
	InboxRetention time.Duration // KFN_INBOX_RETENTION: inbox rows older than this are purged (dedup of Kafka records stays permanent)
	Logger         *slog.Logger  // not bindable; defaults to slog.Default()

	envErrs []error // environment values Bind could not parse
}

// Defaults, chosen from the benchmark in the README (`kfn bench`).
const (
	DefaultBatchSize      = 500
	DefaultBatchWait      = 20 * time.Millisecond
	DefaultMaxRecordBytes = 512 << 10
	DefaultRetryAttempts  = 5
	DefaultRetryInitial   = 100 * time.Millisecond
	DefaultRetryMax       = 5 * time.Second
	DefaultHandlerTimeout = 30 * time.Second
	DefaultLeaseTTL       = 5 * time.Second
	DefaultLeaseRenew     = 1 * time.Second
	DefaultEventDedup     = outbox.DefaultDuplicates
	DefaultInboxRetention = 7 * 24 * time.Hour
	DefaultEventRetention = outbox.DefaultStreamMaxAge
)

// WithDefaults returns a copy with every unset field at its default.
func (c Config) WithDefaults() Config {
	if c.WorkerID == "" {
		host, _ := os.Hostname()
		c.WorkerID = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	setDefault(&c.BatchSize, DefaultBatchSize)
	setDefault(&c.BatchWait, DefaultBatchWait)
	setDefault(&c.MaxRecordBytes, DefaultMaxRecordBytes)
	setDefault(&c.RetryAttempts, DefaultRetryAttempts)
	setDefault(&c.RetryInitial, DefaultRetryInitial)
	setDefault(&c.RetryMax, DefaultRetryMax)
	setDefault(&c.HandlerTimeout, DefaultHandlerTimeout)
	setDefault(&c.StartFrom, "earliest")
	setDefault(&c.LeaseTTL, DefaultLeaseTTL)
	setDefault(&c.LeaseRenew, DefaultLeaseRenew)
	setDefault(&c.StatementTimeout, min(c.LeaseTTL*4/10, c.HandlerTimeout*8/10))
	setDefault(&c.LeaseBucket, lease.DefaultBucket)
	setDefault(&c.EventStream, DefaultStream)
	setDefault(&c.EventDedup, DefaultEventDedup)
	setDefault(&c.InboxRetention, DefaultInboxRetention)
	setDefault(&c.EventRetention, DefaultEventRetention)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func setDefault[T comparable](field *T, def T) {
	var zero T
	if *field == zero {
		*field = def
	}
}

// ConfigError names the field that is wrong and what to do about it.
type ConfigError struct {
	Field string // the flag name, e.g. "kafka-brokers"
	Env   string // the environment variable, e.g. "KFN_KAFKA_BROKERS"
	Msg   string
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("invalid configuration: --%s (%s): %s", e.Field, e.Env, e.Msg)
}

// validate checks every setting; Kafka brokers are required only when a
// function reads Kafka (needKafka).
func (c Config) validate(needKafka bool) error {
	errs := append([]error(nil), c.envErrs...)
	bad := func(field, msg string, args ...any) {
		errs = append(errs, &ConfigError{Field: field, Env: envName(field), Msg: fmt.Sprintf(msg, args...)})
	}
	if needKafka && len(c.KafkaBrokers) == 0 {
		bad("kafka-brokers", "no Kafka broker given: set it to host:port[,host:port…]")
	}
	for _, b := range c.KafkaBrokers {
		if host, port, ok := strings.Cut(b, ":"); !ok || host == "" || !isPort(port) {
			bad("kafka-brokers", "%q is not host:port", b)
		}
	}
	if c.DatabaseURL == "" {
		bad("database-url", "no Postgres URL given: set it to postgres://user@host:port/db")
	} else if u, err := url.Parse(c.DatabaseURL); err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		bad("database-url", "%q is not a postgres:// URL", redactURL(c.DatabaseURL))
	}
	if c.NATSURL == "" {
		bad("nats-url", "no NATS URL given: set it to nats://host:port")
	}
	if c.BatchSize < 1 || c.BatchSize > 10000 {
		bad("batch-size", "%d is out of range 1..10000", c.BatchSize)
	}
	if c.BatchWait < 0 {
		bad("batch-wait", "must not be negative")
	}
	if c.MaxRecordBytes < 1 {
		bad("max-record-bytes", "must be positive")
	}
	if c.RetryAttempts < 1 {
		bad("retry-attempts", "must be at least 1")
	}
	if c.RetryInitial <= 0 || c.RetryMax < c.RetryInitial {
		bad("retry-max", "must be at least --retry-initial (%s)", c.RetryInitial)
	}
	if c.HandlerTimeout <= 0 {
		bad("handler-timeout", "must be positive")
	}
	if c.StartFrom != "earliest" && c.StartFrom != "latest" {
		bad("start-from", "%q is neither earliest nor latest", c.StartFrom)
	}
	if c.EventDedup <= 0 {
		bad("event-dedup", "must be positive")
	}
	if c.EventRetention < c.EventDedup {
		bad("event-retention", "%s is shorter than --event-dedup (%s)", c.EventRetention, c.EventDedup)
	}
	if c.InboxRetention < time.Second {
		bad("inbox-retention", "%s is too short: events republished after it would be applied again", c.InboxRetention)
	}
	if c.LeaseRenew <= 0 || c.LeaseTTL < 3*c.LeaseRenew {
		bad("lease-ttl", "%s must be at least 3 × --lease-renew (%s) so a lease survives a missed renewal", c.LeaseTTL, c.LeaseRenew)
	}
	rt := roundTripLimit(c.StatementTimeout)
	switch {
	case c.StatementTimeout < 10*time.Millisecond:
		bad("statement-timeout", "%s is too short: set it to the longest a Postgres statement of a handler may run, e.g. 2s", c.StatementTimeout)
	case rt > lease.Validity(c.LeaseTTL):
		bad("statement-timeout", "%s is too long for --lease-ttl %s: a round trip unanswered for 5/4 of it (%s) is a frozen connection, and the worker must notice one within the %s (0.7 × --lease-ttl) that a lease stays valid without renewal; lower --statement-timeout to at most %s or raise --lease-ttl to at least %s",
			c.StatementTimeout, c.LeaseTTL, rt, lease.Validity(c.LeaseTTL), lease.Validity(c.LeaseTTL)*4/5, (c.StatementTimeout * 5 / 4 * 10 / 7).Round(time.Millisecond))
	case c.HandlerTimeout > 0 && rt > c.HandlerTimeout:
		bad("handler-timeout", "%s is shorter than 5/4 of --statement-timeout (%s): a slow statement in a handler must be cancelled by Postgres (the record's error, retried and then dead-lettered) before the handler's deadline closes the connection (an infrastructure error, retried forever); raise --handler-timeout to at least %s or lower --statement-timeout to at most %s",
			c.HandlerTimeout, c.StatementTimeout, rt, c.HandlerTimeout*4/5)
	}
	return errors.Join(errs...)
}

// roundTripLimit is how long a worker waits for one Postgres round trip
// before it takes the connection for frozen and closes it: 5/4 of the
// statement timeout, so that a slow statement is cancelled by the server
// first and fails as itself, with the connection intact.
func roundTripLimit(statementTimeout time.Duration) time.Duration { return statementTimeout * 5 / 4 }

func isPort(s string) bool {
	n, err := strconv.Atoi(s)
	return err == nil && n > 0 && n < 65536
}

// redactURL hides a password in a URL before it is printed.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "<unparseable URL>"
	}
	return u.Redacted()
}

// envName maps a flag name to its environment variable.
func envName(field string) string {
	if field == "database-url" {
		return "DATABASE_URL"
	}
	return "KFN_" + strings.ToUpper(strings.ReplaceAll(field, "-", "_"))
}

// Bind registers a flag for every Config field on fs, with the environment
// variable as the default value, so flags win over the environment. Values
// are written into c when fs is parsed.
func (c *Config) Bind(fs *flag.FlagSet) {
	str := func(p *string, name, def, usage string) {
		fs.StringVar(p, name, envOr(name, def), usage+" ["+envName(name)+"]")
	}
	dur := func(p *time.Duration, name string, def time.Duration, usage string) {
		fs.Var(&envDuration{p: p}, name, usage+" ["+envName(name)+"] (default "+def.String()+")")
		if v := os.Getenv(envName(name)); v != "" {
			if err := (&envDuration{p: p}).Set(v); err != nil {
				c.envErrs = append(c.envErrs, &ConfigError{Field: name, Env: envName(name), Msg: err.Error()})
			}
		}
	}
	num := func(p *int, name string, def int, usage string) {
		fs.Var(&envInt{p: p}, name, usage+" ["+envName(name)+"] (default "+strconv.Itoa(def)+")")
		if v := os.Getenv(envName(name)); v != "" {
			if err := (&envInt{p: p}).Set(v); err != nil {
				c.envErrs = append(c.envErrs, &ConfigError{Field: name, Env: envName(name), Msg: err.Error()})
			}
		}
	}
	fs.Func("kafka-brokers", "Kafka bootstrap brokers, host:port[,host:port…] ["+envName("kafka-brokers")+"]", func(s string) error {
		c.KafkaBrokers = splitList(s)
		return nil
	})
	c.KafkaBrokers = splitList(os.Getenv(envName("kafka-brokers")))
	str(&c.DatabaseURL, "database-url", "", "Postgres connection URL")
	str(&c.NATSURL, "nats-url", "", "NATS server URL")
	str(&c.WorkerID, "worker-id", "", "unique worker id (default host-pid)")
	num(&c.BatchSize, "batch-size", DefaultBatchSize, "max records per transaction")
	dur(&c.BatchWait, "batch-wait", DefaultBatchWait, "max wait to fill a batch")
	num(&c.MaxRecordBytes, "max-record-bytes", DefaultMaxRecordBytes, "records larger than this (key, value and headers) are dead-lettered")
	num(&c.RetryAttempts, "retry-attempts", DefaultRetryAttempts, "handler tries per record before dead-lettering")
	dur(&c.RetryInitial, "retry-initial", DefaultRetryInitial, "first retry backoff")
	dur(&c.RetryMax, "retry-max", DefaultRetryMax, "largest retry backoff")
	dur(&c.HandlerTimeout, "handler-timeout", DefaultHandlerTimeout, "max duration of one handler call: a call running longer is dead-lettered as timeout, and abandoned 1s later if it ignores its ctx")
	fs.Var(&envDuration{p: &c.StatementTimeout}, "statement-timeout", "longest a Postgres statement may run (the sessions' statement_timeout); a round trip unanswered for 5/4 of it is a frozen connection ["+envName("statement-timeout")+"] (default 0.4 × --lease-ttl, at most 0.8 × --handler-timeout)")
	if v := os.Getenv(envName("statement-timeout")); v != "" {
		if err := (&envDuration{p: &c.StatementTimeout}).Set(v); err != nil {
			c.envErrs = append(c.envErrs, &ConfigError{Field: "statement-timeout", Env: envName("statement-timeout"), Msg: err.Error()})
		}
	}
	str(&c.StartFrom, "start-from", "earliest", "earliest|latest: where a partition without a cursor starts")
	dur(&c.LeaseTTL, "lease-ttl", DefaultLeaseTTL, "partition lease lifetime without renewal")
	dur(&c.LeaseRenew, "lease-renew", DefaultLeaseRenew, "lease and heartbeat renewal interval")
	str(&c.LeaseBucket, "lease-bucket", lease.DefaultBucket, "NATS KV bucket holding the leases")
	fs.BoolVar(&c.NoRelay, "no-relay", os.Getenv(envName("no-relay")) == "true", "do not run the outbox relay in this process ["+envName("no-relay")+"=true]")
	str(&c.EventStream, "event-stream", DefaultStream, "JetStream stream the outbox events are relayed to")
	dur(&c.EventDedup, "event-dedup", DefaultEventDedup, "duplicate window of the event stream when the relay creates it")
	dur(&c.InboxRetention, "inbox-retention", DefaultInboxRetention, "purge inbox rows older than this")
	dur(&c.EventRetention, "event-retention", DefaultEventRetention, "max age of events in the event stream when the relay creates it")
}

func envOr(field, def string) string {
	if v := os.Getenv(envName(field)); v != "" {
		return v
	}
	if field == "database-url" {
		if v := os.Getenv("KFN_DATABASE_URL"); v != "" {
			return v
		}
	}
	return def
}

func splitList(s string) []string {
	var out []string
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	return out
}

type envDuration struct{ p *time.Duration }

func (d *envDuration) String() string {
	if d.p == nil {
		return ""
	}
	return d.p.String()
}

func (d *envDuration) Set(s string) error {
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("%q is not a duration like 500ms or 5s", s)
	}
	*d.p = v
	return nil
}

type envInt struct{ p *int }

func (n *envInt) String() string {
	if n.p == nil {
		return ""
	}
	return strconv.Itoa(*n.p)
}

func (n *envInt) Set(s string) error {
	v, err := strconv.Atoi(s)
	if err != nil {
		return fmt.Errorf("%q is not a whole number", s)
	}
	*n.p = v
	return nil
}
