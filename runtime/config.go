package runtime

import (
	"flag"
	"fmt"
	"log/slog"
	"os"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/kfn-dev/kfn/internal/settings"
)

// Config is how a worker connects and behaves: the settings a function
// binary reads from its flags and environment variables, for worker.New. Bind makes every field but
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
	BatchMaxBytes  int           // KFN_BATCH_MAX_BYTES: max bytes (keys, values, headers) of a batch's records, reached by its last one
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

	StartFrom     string        // KFN_START_FROM: earliest|latest, where a partition with no cursor starts
	ConsumerGroup string        // KFN_CONSUMER_GROUP: the Kafka consumer group committed offsets are mirrored to; default the function's name
	LeaseTTL      time.Duration // KFN_LEASE_TTL: partition lease lifetime without renewal
	LeaseRenew    time.Duration // KFN_LEASE_RENEW: how often leases and heartbeats are renewed
	LeaseBucket   string        // KFN_LEASE_BUCKET: the NATS KV bucket of the leases; all workers of a function share it
	Lanes         int           // KFN_LANES: lanes a NATS-triggered function's events are spread over by key hash
	// KeyConcurrency (KFN_KEY_CONCURRENCY), when set, is the key-lanes of
	// every function the worker runs (Function.KeyConcurrency), whatever
	// the function sets.
	KeyConcurrency int
	NoRelay        bool          // KFN_NO_RELAY (true/false, 1/0): do not run the outbox relay in this process (run `kfn relay` instead)
	SkipSetup      bool          // KFN_SKIP_SETUP: do not run the functions' Setup at start (run the binary's migrate mode as the schema owner instead)
	EventStream    string        // KFN_EVENT_STREAM: the JetStream stream outbox events are relayed to
	Outbox         string        // KFN_OUTBOX: table (default) or wal, where a function's transaction writes its events (docs/production/wal-outbox.md)
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

	bound *settings.Binder // the flags and variables of Bind, whose bad values the worker reports
}

// WithDefaults returns a copy with every unset (zero) field at its default.
func (c Config) WithDefaults() Config {
	if c.WorkerID == "" {
		host, _ := os.Hostname()
		c.WorkerID = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	setDefault(&c.BatchSize, settings.DefaultBatchSize)
	setDefault(&c.BatchWait, settings.DefaultBatchWait)
	setDefault(&c.BatchMaxBytes, settings.DefaultBatchMaxBytes)
	setDefault(&c.MaxRecordBytes, settings.DefaultMaxRecordBytes)
	setDefault(&c.RetryAttempts, settings.DefaultRetryAttempts)
	setDefault(&c.RetryInitial, settings.DefaultRetryInitial)
	setDefault(&c.RetryMax, settings.DefaultRetryMax)
	setDefault(&c.HandlerTimeout, settings.DefaultHandlerTimeout)
	setDefault(&c.StartFrom, settings.StartFrom.Default)
	setDefault(&c.LeaseTTL, settings.DefaultLeaseTTL)
	setDefault(&c.LeaseRenew, settings.DefaultLeaseRenew)
	setDefault(&c.StatementTimeout, min(c.LeaseTTL*4/10, c.HandlerTimeout*8/10))
	setDefault(&c.LeaseBucket, settings.LeaseBucket.Default)
	setDefault(&c.NATSReplicas, settings.DefaultNATSReplicas)
	setDefault(&c.Lanes, settings.Lanes.Default)
	setDefault(&c.EventStream, DefaultStream)
	setDefault(&c.Outbox, settings.Outbox.Default)
	setDefault(&c.EventDedup, settings.DefaultEventDedup)
	setDefault(&c.InboxRetention, settings.DefaultInboxRetention)
	setDefault(&c.StallAfter, settings.DefaultStallAfter)
	setDefault(&c.EventRetention, settings.DefaultEventRetention)
	setDefault(&c.DeadLetterRetention, settings.DefaultDeadLetterRetention)
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

// Bind registers a flag for every Config field but Logger on fs, each with
// its environment variable, and sets each field to its default, or to its
// variable's value if the variable is set; fs.Parse then writes the flags
// given (flags win over the environment). A given value that does not parse
// or cannot be used, zero included, is reported naming the flag and the
// variable by the worker.New that c is passed to.
func (c *Config) Bind(fs *flag.FlagSet) { c.bind(settings.NewBinder(fs)) }

// bind binds every setting of Config to its field; b's errors are c's.
func (c *Config) bind(b *settings.Binder) {
	c.bound = b
	settings.KafkaBrokers.Bind(b, &c.KafkaBrokers)
	settings.DatabaseURL.Bind(b, &c.DatabaseURL)
	settings.NATSURL.Bind(b, &c.NATSURL)
	c.NATSSecurity.bind(b)
	settings.NATSReplicas.Bind(b, &c.NATSReplicas)
	settings.NATSProvisioned.Bind(b, &c.NATSProvisioned)
	settings.WorkerID.Bind(b, &c.WorkerID)
	settings.BatchSize.Bind(b, &c.BatchSize)
	settings.BatchMaxBytes.Bind(b, &c.BatchMaxBytes)
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
	settings.KeyConcurrency.Bind(b, &c.KeyConcurrency)
	settings.NoRelay.Bind(b, &c.NoRelay)
	settings.SkipSetup.Bind(b, &c.SkipSetup)
	settings.EventStream.Bind(b, &c.EventStream)
	settings.Outbox.Bind(b, &c.Outbox)
	settings.EventDedup.Bind(b, &c.EventDedup)
	settings.InboxRetention.Bind(b, &c.InboxRetention)
	settings.EventRetention.Bind(b, &c.EventRetention)
	settings.DeadLetterRetention.Bind(b, &c.DeadLetterRetention)
	settings.StallAfter.Bind(b, &c.StallAfter)
	c.KafkaSecurity.bind(b)
}
