package engine

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/internal/settings"
)

// Config is how a worker connects and behaves. Bind makes every field but
// Logger a flag and an environment variable (run a function binary with -h
// to list them); a flag or variable set to zero is checked like any other
// value, and is either honoured (--batch-wait 0) or rejected with an error
// naming both (--batch-size 0). For a Go caller, a zero field means the
// default (see WithDefaults).
type Config struct {
	KafkaBrokers   []string      // KFN_KAFKA_BROKERS: comma-separated host:port list
	DatabaseURL    string        // DATABASE_URL: Postgres connection URL
	NATSURL        string        // KFN_NATS_URL: NATS server URL
	WorkerID       string        // KFN_WORKER_ID: unique per process; default host-pid
	BatchSize      int           // KFN_BATCH_SIZE: max records per transaction
	BatchWait      time.Duration // KFN_BATCH_WAIT: max time to wait to fill a batch; negative: no wait (the flag's 0)
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
	ConsumerGroup  string        // KFN_CONSUMER_GROUP: the Kafka consumer group committed offsets are mirrored to; default the function's name
	LeaseTTL       time.Duration // KFN_LEASE_TTL: partition lease lifetime without renewal
	LeaseRenew     time.Duration // KFN_LEASE_RENEW: how often leases and heartbeats are renewed
	LeaseBucket    string        // KFN_LEASE_BUCKET: the NATS KV bucket of the leases; all workers of a function share it
	Lanes          int           // KFN_LANES: lanes a NATS-triggered function's events are spread over by key hash
	NoRelay        bool          // KFN_NO_RELAY (true/false, 1/0): do not run the outbox relay in this process (run `kfn relay` instead)
	SkipSetup      bool          // KFN_SKIP_SETUP: do not run the functions' Setup at start (run the binary's migrate mode as the schema owner instead)
	EventStream    string        // KFN_EVENT_STREAM: the JetStream stream outbox events are relayed to
	EventDedup     time.Duration // KFN_EVENT_DEDUP: the stream's duplicate window, when the relay creates it
	EventRetention time.Duration // KFN_EVENT_RETENTION: the event stream's max age, when the relay creates it
	InboxRetention time.Duration // KFN_INBOX_RETENTION: inbox rows older than this are purged (dedup of Kafka records stays permanent)
	Logger         *slog.Logger  // not bindable; defaults to slog.Default()

	// TracerProvider (not bindable) receives the spans of batches, handler
	// calls and relay publishes. Nil: the worker reads the standard OTEL_*
	// variables (tracing off unless they enable it; see internal/tracing)
	// and flushes the exporter when it stops. A provider set here is the
	// caller's to shut down.
	TracerProvider trace.TracerProvider

	// DeadLetterRetention (KFN_DEAD_LETTER_RETENTION): dead letters older
	// than this are deleted, each purge audited; negative: they are kept
	// (the flag's 0).
	DeadLetterRetention time.Duration

	// StallAfter (KFN_STALL_AFTER): a lane with lag and no commit for longer
	// counts in kfn_lanes_stalled.
	StallAfter time.Duration

	// KafkaSecurity is how the worker connects to Kafka: TLS (KFN_KAFKA_TLS,
	// KFN_KAFKA_CA, KFN_KAFKA_CERT, KFN_KAFKA_KEY, KFN_KAFKA_SERVER_NAME)
	// and SASL (KFN_KAFKA_SASL_MECHANISM, KFN_KAFKA_SASL_USER, and the
	// password from KFN_KAFKA_SASL_PASSWORD or KFN_KAFKA_SASL_PASSWORD_FILE).
	// Zero: plain TCP.
	KafkaSecurity KafkaSecurity

	// NATSSecurity is how the worker proves itself to NATS and checks the
	// server: a credentials file (KFN_NATS_CREDS), an NKey seed file
	// (KFN_NATS_NKEY) or a token file (KFN_NATS_TOKEN_FILE), and TLS
	// (KFN_NATS_CA, KFN_NATS_CERT, KFN_NATS_KEY). Zero: what NATSURL says.
	NATSSecurity NATSSecurity

	// NATSReplicas (KFN_NATS_REPLICAS) is the number of replicas of the
	// lease bucket and the event stream when the worker creates them; an
	// existing one with another number is an error, never changed.
	// Default 1; 3 in production.
	NATSReplicas int

	// NATSProvisioned (KFN_NATS_PROVISIONED): the lease bucket and the
	// event stream were made by `kfn migrate --nats`; the worker never
	// creates nor changes them, and says what is missing.
	NATSProvisioned bool

	bound *settings.Binder // the flags and variables of Bind, whose bad values validate reports
}

// KafkaSecurity is the TLS and SASL configuration of the worker's Kafka
// connections (runtime.KafkaSecurity).
type KafkaSecurity = kafkaconn.Security

// NATSSecurity is the credentials and TLS configuration of the worker's
// NATS connection (runtime.NATSSecurity).
type NATSSecurity = connect.NATSSecurity

// BindNATSSecurity registers the NATS credential and TLS flags (and their
// variables) on b, for a worker, the relay and every kfn command that
// connects to NATS.
func BindNATSSecurity(b *settings.Binder, s *NATSSecurity) {
	settings.NATSCreds.Bind(b, &s.Creds)
	settings.NATSNKey.Bind(b, &s.NKeyFile)
	settings.NATSTokenFile.Bind(b, &s.TokenFile)
	settings.NATSCA.Bind(b, &s.CAFile)
	settings.NATSCert.Bind(b, &s.CertFile)
	settings.NATSKey.Bind(b, &s.KeyFile)
}

// Defaults, chosen from the benchmark (`kfn bench`, docs/benchmarks.md).
// The generated configuration reference (docs/reference/configuration.md)
// and a function binary's -h show their values.
const (
	DefaultBatchSize      = settings.DefaultBatchSize
	DefaultBatchWait      = settings.DefaultBatchWait
	DefaultMaxRecordBytes = settings.DefaultMaxRecordBytes
	DefaultRetryAttempts  = settings.DefaultRetryAttempts
	DefaultRetryInitial   = settings.DefaultRetryInitial
	DefaultRetryMax       = settings.DefaultRetryMax
	DefaultHandlerTimeout = settings.DefaultHandlerTimeout
	DefaultStallAfter     = settings.DefaultStallAfter
	DefaultLeaseTTL       = settings.DefaultLeaseTTL
	DefaultLeaseRenew     = settings.DefaultLeaseRenew
	DefaultEventDedup     = settings.DefaultEventDedup
	DefaultInboxRetention = settings.DefaultInboxRetention
	DefaultEventRetention = settings.DefaultEventRetention

	DefaultDeadLetterRetention = settings.DefaultDeadLetterRetention
)

// WithDefaults returns a copy with every unset (zero) field at its default.
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
	setDefault(&c.StartFrom, settings.StartFrom.Default)
	setDefault(&c.LeaseTTL, DefaultLeaseTTL)
	setDefault(&c.LeaseRenew, DefaultLeaseRenew)
	setDefault(&c.StatementTimeout, min(c.LeaseTTL*4/10, c.HandlerTimeout*8/10))
	setDefault(&c.LeaseBucket, settings.LeaseBucket.Default)
	setDefault(&c.NATSReplicas, settings.DefaultNATSReplicas)
	setDefault(&c.Lanes, settings.Lanes.Default)
	setDefault(&c.EventStream, DefaultStream)
	setDefault(&c.EventDedup, DefaultEventDedup)
	setDefault(&c.InboxRetention, DefaultInboxRetention)
	setDefault(&c.StallAfter, DefaultStallAfter)
	setDefault(&c.EventRetention, DefaultEventRetention)
	setDefault(&c.DeadLetterRetention, DefaultDeadLetterRetention)
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
	if e.Field == "" { // a variable with no flag
		return fmt.Sprintf("invalid configuration: %s: %s", e.Env, e.Msg)
	}
	return fmt.Sprintf("invalid configuration: --%s (%s): %s", e.Field, e.Env, e.Msg)
}

// configError is a ConfigError about setting s.
func configError[T any](s settings.Setting[T], msg string, args ...any) *ConfigError {
	return &ConfigError{Field: s.Flag, Env: s.Env, Msg: fmt.Sprintf(msg, args...)}
}

// validate checks every setting; Kafka brokers are required only when a
// function reads Kafka (needKafka). A value given to Bind that was rejected
// is reported as given, and not again as missing: its field kept the default.
func (c Config) validate(needKafka bool) error {
	var errs []error
	add := func(problems []*settings.Error) {
		for _, e := range problems {
			errs = append(errs, &ConfigError{Field: e.Flag, Env: e.Env, Msg: e.Msg})
		}
	}
	bad := func(err *ConfigError) { errs = append(errs, err) }
	rejected := map[string]bool{}
	if c.bound != nil {
		given := c.bound.Errors()
		for _, e := range given {
			rejected[e.Flag] = true
		}
		add(given)
	}
	if needKafka && len(c.KafkaBrokers) == 0 && !rejected[settings.KafkaBrokers.Flag] {
		bad(configError(settings.KafkaBrokers, "no Kafka broker given: set it to host:port[,host:port…]"))
	}
	add(settings.KafkaBrokers.Problems(c.KafkaBrokers))
	if needKafka {
		for _, e := range c.KafkaSecurity.Problems() {
			if !rejected[e.Flag] {
				add([]*settings.Error{e})
			}
		}
	}
	if c.DatabaseURL == "" && !rejected[settings.DatabaseURL.Flag] {
		bad(configError(settings.DatabaseURL, "no Postgres URL given: set it to postgres://user@host:port/db"))
	}
	add(settings.DatabaseURL.Problems(c.DatabaseURL))
	if c.NATSURL == "" {
		bad(configError(settings.NATSURL, "no NATS URL given: set it to nats://host:port"))
	}
	var badNATS *connect.SettingError
	if err := c.NATSSecurity.Check(); errors.As(err, &badNATS) && !rejected[badNATS.Flag] {
		bad(&ConfigError{Field: badNATS.Flag, Env: badNATS.Env, Msg: badNATS.Msg})
	}
	add(settings.NATSReplicas.Problems(c.NATSReplicas))
	// BatchWait: any value goes, a negative one is no wait.
	add(settings.BatchSize.Problems(c.BatchSize))
	add(settings.MaxRecordBytes.Problems(c.MaxRecordBytes))
	add(settings.RetryAttempts.Problems(c.RetryAttempts))
	add(settings.RetryInitial.Problems(c.RetryInitial))
	if c.RetryInitial > 0 && c.RetryMax < c.RetryInitial {
		bad(configError(settings.RetryMax, "must be at least --retry-initial (%s)", c.RetryInitial))
	}
	add(settings.HandlerTimeout.Problems(c.HandlerTimeout))
	add(settings.StartFrom.Problems(c.StartFrom))
	add(settings.EventDedup.Problems(c.EventDedup))
	if c.EventRetention < c.EventDedup {
		bad(configError(settings.EventRetention, "%s is shorter than --event-dedup (%s)", c.EventRetention, c.EventDedup))
	}
	add(settings.InboxRetention.Problems(c.InboxRetention))
	add(settings.Lanes.Problems(c.Lanes))
	add(settings.LeaseRenew.Problems(c.LeaseRenew))
	if c.LeaseRenew > 0 && c.LeaseTTL < 3*c.LeaseRenew {
		bad(configError(settings.LeaseTTL, "%s must be at least 3 × --lease-renew (%s) so a lease survives a missed renewal", c.LeaseTTL, c.LeaseRenew))
	}
	rt := roundTripLimit(c.StatementTimeout)
	switch tooShort := settings.StatementTimeout.Problems(c.StatementTimeout); {
	case len(tooShort) > 0:
		add(tooShort)
	case rt > lease.Validity(c.LeaseTTL):
		bad(configError(settings.StatementTimeout, "%s is too long for --lease-ttl %s: a round trip unanswered for 5/4 of it (%s) is a frozen connection, and the worker must notice one within the %s (0.7 × --lease-ttl) that a lease stays valid without renewal; lower --statement-timeout to at most %s or raise --lease-ttl to at least %s",
			c.StatementTimeout, c.LeaseTTL, rt, lease.Validity(c.LeaseTTL), lease.Validity(c.LeaseTTL)*4/5, (c.StatementTimeout * 5 / 4 * 10 / 7).Round(time.Millisecond)))
	case c.HandlerTimeout > 0 && rt > c.HandlerTimeout:
		bad(configError(settings.HandlerTimeout, "%s is shorter than 5/4 of --statement-timeout (%s): a slow statement in a handler must be cancelled by Postgres (the record's error, retried and then dead-lettered) before the handler's deadline closes the connection (an infrastructure error, retried forever); raise --handler-timeout to at least %s or lower --statement-timeout to at most %s",
			c.HandlerTimeout, c.StatementTimeout, rt, c.HandlerTimeout*4/5))
	}
	return errors.Join(errs...)
}

// roundTripLimit is how long a worker waits for one Postgres round trip
// before it takes the connection for frozen and closes it: 5/4 of the
// statement timeout, so that a slow statement is cancelled by the server
// first and fails as itself, with the connection intact.
func roundTripLimit(statementTimeout time.Duration) time.Duration { return statementTimeout * 5 / 4 }

// Bind registers a flag for every Config field but Logger on fs, each with
// its environment variable, and sets each field to its default, or to its
// variable's value if the variable is set; fs.Parse then writes the flags
// given (flags win over the environment). A given value that does not parse
// or cannot be used, zero included, is reported naming the flag and the
// variable by the NewWorker or NewRelay that c is passed to.
func (c *Config) Bind(fs *flag.FlagSet) { c.bind(settings.NewBinder(fs)) }

// bind binds every setting of Config to its field; b's errors are c's.
func (c *Config) bind(b *settings.Binder) {
	c.bound = b
	settings.KafkaBrokers.Bind(b, &c.KafkaBrokers)
	settings.DatabaseURL.Bind(b, &c.DatabaseURL)
	settings.NATSURL.Bind(b, &c.NATSURL)
	BindNATSSecurity(b, &c.NATSSecurity)
	settings.NATSReplicas.Bind(b, &c.NATSReplicas)
	settings.NATSProvisioned.Bind(b, &c.NATSProvisioned)
	settings.WorkerID.Bind(b, &c.WorkerID)
	settings.BatchSize.Bind(b, &c.BatchSize)
	settings.BatchWait.Bind(b, &c.BatchWait)
	settings.MaxRecordBytes.Bind(b, &c.MaxRecordBytes)
	settings.RetryAttempts.Bind(b, &c.RetryAttempts)
	settings.RetryInitial.Bind(b, &c.RetryInitial)
	settings.RetryMax.Bind(b, &c.RetryMax)
	settings.HandlerTimeout.Bind(b, &c.HandlerTimeout)
	settings.StatementTimeout.Bind(b, &c.StatementTimeout)
	settings.StartFrom.Bind(b, &c.StartFrom)
	settings.ConsumerGroup.Bind(b, &c.ConsumerGroup)
	settings.LeaseTTL.Bind(b, &c.LeaseTTL)
	settings.LeaseRenew.Bind(b, &c.LeaseRenew)
	settings.LeaseBucket.Bind(b, &c.LeaseBucket)
	settings.Lanes.Bind(b, &c.Lanes)
	settings.NoRelay.Bind(b, &c.NoRelay)
	settings.SkipSetup.Bind(b, &c.SkipSetup)
	settings.EventStream.Bind(b, &c.EventStream)
	settings.EventDedup.Bind(b, &c.EventDedup)
	settings.InboxRetention.Bind(b, &c.InboxRetention)
	settings.EventRetention.Bind(b, &c.EventRetention)
	settings.DeadLetterRetention.Bind(b, &c.DeadLetterRetention)
	settings.StallAfter.Bind(b, &c.StallAfter)
	c.KafkaSecurity.Bind(b)
}
