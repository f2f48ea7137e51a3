package settings

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/internal/redact"
	"github.com/kfn-dev/kfn/outbox"
)

// Defaults of the worker's settings, chosen from the benchmark (`kfn bench`,
// docs/benchmarks.md); package runtime exports them under the same names.
const (
	DefaultBatchSize      = 500
	DefaultBatchWait      = 20 * time.Millisecond
	DefaultMaxRecordBytes = 512 << 10
	DefaultBatchMaxBytes  = 8 << 20
	DefaultRetryAttempts  = 5
	DefaultRetryInitial   = 100 * time.Millisecond
	DefaultRetryMax       = 5 * time.Second
	DefaultHandlerTimeout = 30 * time.Second
	DefaultLeaseTTL       = lease.DefaultTTL
	DefaultLeaseRenew     = lease.DefaultRenewEvery
	DefaultEventStream    = outbox.DefaultStream
	DefaultEventDedup     = outbox.DefaultDuplicates
	DefaultEventRetention = outbox.DefaultStreamMaxAge
	DefaultInboxRetention = 7 * 24 * time.Hour
	DefaultNATSReplicas   = 1
	MaxKeyConcurrency     = 256

	DefaultDeadLetterRetention = 30 * 24 * time.Hour
)

// KafkaSASLPasswordEnv holds the SASL password for Kafka. It has no flag,
// so that the password never shows in a process list.
const KafkaSASLPasswordEnv = "KFN_KAFKA_SASL_PASSWORD"

// KafkaOAuthClientSecretEnv holds the OAuth client secret of the
// OAUTHBEARER client-credentials flow. It has no flag either.
const KafkaOAuthClientSecretEnv = "KFN_KAFKA_OAUTH_CLIENT_SECRET"

// The SASL mechanisms of --kafka-sasl-mechanism. AWS_MSK_IAM is built into
// a binary only when its main imports the opt-in module
// github.com/kfn-dev/kfn/kafkaauth/mskiam (internal/kafkaconn says so).
const (
	SASLPlain       = "PLAIN"
	SASLScramSHA256 = "SCRAM-SHA-256"
	SASLScramSHA512 = "SCRAM-SHA-512"
	SASLOAuthBearer = "OAUTHBEARER"
	SASLAWSMSKIAM   = "AWS_MSK_IAM"
)

// The OpenTelemetry variables (the specification's names, no flags) that
// decide whether a worker or kfn relay exports traces; internal/tracing
// reads them, and Variables says what each does. The OpenTelemetry SDK
// reads the other OTEL_* variables itself (OTEL_SERVICE_NAME,
// OTEL_EXPORTER_OTLP_HEADERS, …).
const (
	OTelSDKDisabledEnv     = "OTEL_SDK_DISABLED"
	OTelTracesExporterEnv  = "OTEL_TRACES_EXPORTER"
	OTelEndpointEnv        = "OTEL_EXPORTER_OTLP_ENDPOINT"
	OTelTracesEndpointEnv  = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	OTelProtocolEnv        = "OTEL_EXPORTER_OTLP_PROTOCOL"
	OTelTracesProtocolEnv  = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	OTelResourceAttributes = "OTEL_RESOURCE_ATTRIBUTES"
)

// Connections: the workers' and most kfn commands'.
var (
	DatabaseURL = Setting[string]{
		Flag: "database-url", Env: "DATABASE_URL", OldEnv: "KFN_DATABASE_URL",
		Usage: "Postgres connection URL or keyword/value string", Check: postgresURL, Secret: true,
	}
	FunctionDatabases = Setting[[]string]{
		Flag: "function-databases", Env: "KFN_FUNCTION_DATABASES",
		Usage: "the functions on a database of their own, as FUNCTION=URL,…: kfn's operator commands use a function's own database for it and --database-url for the others",
		Check: functionDatabases, Secret: true,
	}
	NATSURL = Setting[string]{
		Flag: "nats-url", Env: "KFN_NATS_URL",
		Usage: "NATS server URL (JetStream enabled)", Secret: true,
	}
	NATSCreds = Setting[string]{
		Flag: "nats-creds", Env: "KFN_NATS_CREDS",
		Usage: "NATS credentials file (.creds: a user JWT and its NKey seed)",
	}
	NATSTokenFile = Setting[string]{
		Flag: "nats-token-file", Env: "KFN_NATS_TOKEN_FILE",
		Usage: "file holding the NATS token, read once at start",
	}
	NATSNKey = Setting[string]{
		Flag: "nats-nkey", Env: "KFN_NATS_NKEY",
		Usage: "file holding a NATS user NKey seed (SU…), for a server that lists the user's public key",
	}
	NATSCA = Setting[string]{
		Flag: "nats-ca", Env: "KFN_NATS_CA",
		Usage: "PEM file of the CA certificates that sign the NATS servers' certificates (connects over TLS)",
	}
	NATSCert = Setting[string]{
		Flag: "nats-cert", Env: "KFN_NATS_CERT",
		Usage: "PEM file of the client certificate for NATS (mutual TLS; needs --nats-key)",
	}
	NATSKey = Setting[string]{
		Flag: "nats-key", Env: "KFN_NATS_KEY",
		Usage: "PEM file of the private key of --nats-cert",
	}
	NATSReplicas = Setting[int]{
		Flag: "nats-replicas", Env: "KFN_NATS_REPLICAS", Default: DefaultNATSReplicas,
		Usage: "replicas of the JetStream state kfn creates (lease bucket, event stream); 3 in production, on a NATS cluster of 3 or more", Check: between(1, 5),
	}
	NATSProvisioned = Setting[bool]{
		Flag: "nats-provisioned", Env: "KFN_NATS_PROVISIONED",
		Usage: "never create or change the lease bucket and the event stream: kfn migrate --nats made them (the NATS user then needs no JetStream admin rights)",
	}
	KafkaBrokers = Setting[[]string]{
		Flag: "kafka-brokers", Env: "KFN_KAFKA_BROKERS",
		Usage: "Kafka bootstrap brokers, host:port[,host:port…]", Check: hostPorts,
	}
	LeaseBucket = Setting[string]{
		Flag: "lease-bucket", Env: "KFN_LEASE_BUCKET", Default: lease.DefaultBucket,
		Usage: "NATS KV bucket of the workers' leases; all workers of a function share it", Check: notEmpty,
	}
	Outbox = Setting[string]{
		Flag: "outbox", Env: "KFN_OUTBOX", Default: string(outbox.ModeTable),
		Usage: "where a function's transaction writes its events: table (kfn.outbox rows) or wal (logical decoding messages, read by the relay from a replication slot; needs wal_level=logical and `kfn migrate --outbox wal`)",
		Check: func(s string) error { _, err := outbox.ParseMode(s); return err },
	}
	EventStream = Setting[string]{
		Flag: "event-stream", Env: "KFN_EVENT_STREAM", Default: DefaultEventStream,
		Usage: "JetStream stream the outbox events are relayed to", Check: notEmpty,
	}

	// Kafka security (TLS and SASL), for the workers and every kfn command
	// that talks to Kafka; internal/kafkaconn binds and applies them. The
	// SASL password is never a flag: KafkaSASLPasswordEnv or the file of
	// KafkaSASLPasswordFile.
	KafkaTLS = Setting[bool]{
		Flag: "kafka-tls", Env: "KFN_KAFKA_TLS",
		Usage: "connect to Kafka over TLS (implied by --kafka-ca, --kafka-cert and --kafka-server-name)",
	}
	KafkaCA = Setting[string]{
		Flag: "kafka-ca", Env: "KFN_KAFKA_CA",
		Usage: "PEM file of the CA certificates that sign Kafka's brokers (default: the system's)",
	}
	KafkaCert = Setting[string]{
		Flag: "kafka-cert", Env: "KFN_KAFKA_CERT",
		Usage: "PEM file of the client certificate for Kafka (mutual TLS; needs --kafka-key)",
	}
	KafkaKey = Setting[string]{
		Flag: "kafka-key", Env: "KFN_KAFKA_KEY",
		Usage: "PEM file of the private key of --kafka-cert",
	}
	KafkaServerName = Setting[string]{
		Flag: "kafka-server-name", Env: "KFN_KAFKA_SERVER_NAME",
		Usage: "name the brokers' certificates are verified against, when not the host of the broker address",
	}
	KafkaSASLMechanism = Setting[string]{
		Flag: "kafka-sasl-mechanism", Env: "KFN_KAFKA_SASL_MECHANISM",
		Usage: "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (with --kafka-sasl-user and " + KafkaSASLPasswordEnv + "), OAUTHBEARER (with --kafka-oauth-token-url or --kafka-oauth-token-file) or AWS_MSK_IAM (a binary that imports github.com/kfn-dev/kfn/kafkaauth/mskiam)",
		Check: func(s string) error {
			switch s {
			case "", SASLPlain, SASLScramSHA256, SASLScramSHA512, SASLOAuthBearer, SASLAWSMSKIAM:
				return nil
			}
			return fmt.Errorf("%q is not a SASL mechanism: use PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER or AWS_MSK_IAM", s)
		},
	}
	KafkaSASLUser = Setting[string]{
		Flag: "kafka-sasl-user", Env: "KFN_KAFKA_SASL_USER",
		Usage: "SASL user name for Kafka",
	}
	KafkaSASLPasswordFile = Setting[string]{
		Flag: "kafka-sasl-password-file", Env: "KFN_KAFKA_SASL_PASSWORD_FILE",
		Usage: "file holding the SASL password for Kafka (or set " + KafkaSASLPasswordEnv + "; never a flag)",
	}
	KafkaOAuthTokenURL = Setting[string]{
		Flag: "kafka-oauth-token-url", Env: "KFN_KAFKA_OAUTH_TOKEN_URL",
		Usage: "OAUTHBEARER: the OAuth/OIDC token endpoint kfn gets its Kafka tokens from (client-credentials flow, with --kafka-oauth-client-id and " + KafkaOAuthClientSecretEnv + ")",
		Check: func(s string) error {
			if s == "" {
				return nil
			}
			u, err := url.Parse(s)
			if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
				return fmt.Errorf("%q is not an http(s) URL", s)
			}
			return nil
		},
	}
	KafkaOAuthClientID = Setting[string]{
		Flag: "kafka-oauth-client-id", Env: "KFN_KAFKA_OAUTH_CLIENT_ID",
		Usage: "OAUTHBEARER: the OAuth client id of the client-credentials flow",
	}
	KafkaOAuthClientSecretFile = Setting[string]{
		Flag: "kafka-oauth-client-secret-file", Env: "KFN_KAFKA_OAUTH_CLIENT_SECRET_FILE",
		Usage: "OAUTHBEARER: file holding the OAuth client secret (or set " + KafkaOAuthClientSecretEnv + "; never a flag)",
	}
	KafkaOAuthScopes = Setting[[]string]{
		Flag: "kafka-oauth-scopes", Env: "KFN_KAFKA_OAUTH_SCOPES",
		Usage: "OAUTHBEARER: scopes asked for in the client-credentials flow, comma-separated",
	}
	KafkaOAuthTokenFile = Setting[string]{
		Flag: "kafka-oauth-token-file", Env: "KFN_KAFKA_OAUTH_TOKEN_FILE",
		Usage: "OAUTHBEARER: file holding the token itself (a JWT another process keeps fresh), read again whenever it changes; instead of --kafka-oauth-token-url",
	}
	KafkaOAuthExtensions = Setting[[]string]{
		Flag: "kafka-oauth-extensions", Env: "KFN_KAFKA_OAUTH_EXTENSIONS",
		Usage: "OAUTHBEARER: SASL extensions sent with the token, key=value, comma-separated (Confluent Cloud: logicalCluster=lkc-…,identityPoolId=pool-…)",
		Check: func(kvs []string) error {
			for _, kv := range kvs {
				k, v, ok := strings.Cut(kv, "=")
				if !ok || !oauthExtensionKey(k) || !oauthExtensionValue(v) {
					return fmt.Errorf("%q is not key=value with a key of letters only, other than auth, and a value of printable ASCII (RFC 7628)", kv)
				}
			}
			return nil
		},
	}
)

// The worker's.
var (
	WorkerID = Setting[string]{
		Flag: "worker-id", Env: "KFN_WORKER_ID", DefaultText: "host-pid",
		Usage: "unique per process: the lease owner",
	}
	BatchSize = Setting[int]{
		Flag: "batch-size", Env: "KFN_BATCH_SIZE", Default: DefaultBatchSize,
		Usage: "max records per transaction", Check: between(1, 10000),
	}
	BatchWait = Setting[time.Duration]{
		Flag: "batch-wait", Env: "KFN_BATCH_WAIT", Default: DefaultBatchWait,
		Usage: "max wait to fill a batch after its first record; 0: no wait",
		Check: func(d time.Duration) error {
			if d < 0 {
				return errors.New("must not be negative (0: no wait)")
			}
			return nil
		},
		ZeroAs: -1, // runtime.Config's BatchWait: zero is the default, negative is no wait
	}
	BatchMaxBytes = Setting[int]{
		Flag: "batch-max-bytes", Env: "KFN_BATCH_MAX_BYTES", Default: DefaultBatchMaxBytes,
		Usage: "a batch takes records until their bytes (keys, values and headers) reach this, as well as --batch-size records; it bounds a lane's memory (a batch applied, the next one read, a fetch of at most 1 MiB)",
		Check: positive[int],
	}
	MaxRecordBytes = Setting[int]{
		Flag: "max-record-bytes", Env: "KFN_MAX_RECORD_BYTES", Default: DefaultMaxRecordBytes,
		Usage: "records larger than this (key, value and headers) are dead-lettered as oversized", Check: positive[int],
	}
	RetryAttempts = Setting[int]{
		Flag: "retry-attempts", Env: "KFN_RETRY_ATTEMPTS", Default: DefaultRetryAttempts,
		Usage: "handler tries per record before it is dead-lettered", Check: atLeast(1),
	}
	RetryInitial = Setting[time.Duration]{
		Flag: "retry-initial", Env: "KFN_RETRY_INITIAL", Default: DefaultRetryInitial,
		Usage: "first backoff between handler tries", Check: positive[time.Duration],
	}
	RetryMax = Setting[time.Duration]{
		Flag: "retry-max", Env: "KFN_RETRY_MAX", Default: DefaultRetryMax,
		Usage: "largest backoff between handler tries", Check: positive[time.Duration],
	}
	HandlerTimeout = Setting[time.Duration]{
		Flag: "handler-timeout", Env: "KFN_HANDLER_TIMEOUT", Default: DefaultHandlerTimeout,
		Usage: "max duration of one handler call: a call running longer is dead-lettered as timeout, and abandoned 1s later if it ignores its ctx",
		Check: positive[time.Duration],
	}
	StatementTimeout = Setting[time.Duration]{
		Flag: "statement-timeout", Env: "KFN_STATEMENT_TIMEOUT", DefaultText: "0.4 × --lease-ttl, at most 0.8 × --handler-timeout",
		Usage: "longest a Postgres statement may run (the sessions' statement_timeout); a round trip unanswered for 5/4 of it is a frozen connection",
		Check: func(d time.Duration) error {
			if d < 10*time.Millisecond {
				return fmt.Errorf("%s is too short: set it to the longest a Postgres statement of a handler may run, e.g. 2s", d)
			}
			return nil
		},
	}
	StartFrom = Setting[string]{
		Flag: "start-from", Env: "KFN_START_FROM", Default: "earliest",
		Usage: "earliest|latest: where a partition without a cursor starts",
		Check: func(s string) error {
			if s != "earliest" && s != "latest" {
				return fmt.Errorf("%q is neither earliest nor latest", s)
			}
			return nil
		},
	}
	ConsumerGroup = Setting[string]{
		Flag: "consumer-group", Env: "KFN_CONSUMER_GROUP", DefaultText: "the function's name",
		Usage: "Kafka consumer group kfn mirrors its committed offsets to, for lag tools; never one with members or offsets kfn did not write",
	}
	LeaseTTL = Setting[time.Duration]{
		Flag: "lease-ttl", Env: "KFN_LEASE_TTL", Default: DefaultLeaseTTL,
		Usage: "partition lease lifetime without renewal", Check: positive[time.Duration],
	}
	LeaseRenew = Setting[time.Duration]{
		Flag: "lease-renew", Env: "KFN_LEASE_RENEW", Default: DefaultLeaseRenew,
		Usage: "lease and heartbeat renewal period", Check: positive[time.Duration],
	}
	Lanes = Setting[int]{
		Flag: "lanes", Env: "KFN_LANES", Default: 1,
		Usage: "lanes a NATS-triggered function's events are spread over by key hash, each with its own lease; the newest-started worker's count wins (README: Lanes)",
		Check: between(1, 256),
	}
	KeyConcurrency = Setting[int]{
		Flag: "key-concurrency", Env: "KFN_KEY_CONCURRENCY",
		Usage: "key-lanes per partition (or subject lane): records are split over them by key hash and committed side by side, in order per key; each needs a Postgres connection; 0: the function's KeyConcurrency, 1 unless it sets one (docs/scaling.md)",
		Check: between(0, MaxKeyConcurrency),
	}
	NoRelay = Setting[bool]{
		Flag: "no-relay", Env: "KFN_NO_RELAY",
		Usage: "do not run the outbox relay in this process (run kfn relay instead)",
	}
	SkipSetup = Setting[bool]{
		Flag: "skip-setup", Env: "KFN_SKIP_SETUP",
		Usage: "do not run the function's Setup DDL at start (run `<function binary> migrate` once as the schema owner instead), so the worker needs only DML rights",
	}
	EventDedup = Setting[time.Duration]{
		Flag: "event-dedup", Env: "KFN_EVENT_DEDUP", Default: DefaultEventDedup,
		Usage: "duplicate window of the event stream, when the relay creates it", Check: positive[time.Duration],
	}
	EventRetention = Setting[time.Duration]{
		Flag: "event-retention", Env: "KFN_EVENT_RETENTION", Default: DefaultEventRetention,
		Usage: "max age of events in the event stream, when the relay creates it", Check: positive[time.Duration],
	}
	InboxRetention = Setting[time.Duration]{
		Flag: "inbox-retention", Env: "KFN_INBOX_RETENTION", Default: DefaultInboxRetention,
		Usage: "inbox rows older than this are purged (the dedup of Kafka records stays)",
		Check: func(d time.Duration) error {
			if d < time.Second {
				return fmt.Errorf("%s is too short: events republished after it would be applied again", d)
			}
			return nil
		},
	}
	DeadLetterRetention = Setting[time.Duration]{
		Flag: "dead-letter-retention", Env: "KFN_DEAD_LETTER_RETENTION", Default: DefaultDeadLetterRetention,
		Usage: "dead letters older than this are deleted (audited); 0: keep them",
		Check: func(d time.Duration) error {
			if d < 0 {
				return errors.New("must not be negative (0: keep dead letters until kfn dlq discard or purge)")
			}
			return nil
		},
		ZeroAs: -1, // runtime.Config's DeadLetterRetention: zero is the default, negative is keep
	}
	LogLevel = Setting[string]{
		Flag: "log-level", Env: "KFN_LOG_LEVEL", Default: "info",
		Usage: "debug|info|warn|error",
		Check: func(s string) error {
			var l slog.Level
			if l.UnmarshalText([]byte(s)) != nil {
				return fmt.Errorf("%q is not a log level: use debug, info, warn or error", s)
			}
			return nil
		},
	}
	MetricsAddr = Setting[string]{
		Flag: "metrics-addr", Env: "KFN_METRICS_ADDR",
		Usage: "serve Prometheus /metrics, /healthz and /readyz on this address, e.g. :9464",
	}
)

// The relay's (`kfn relay`); it also takes the connections, the worker id,
// the lease timing and the event stream settings.
var RelaySubjects = Setting[[]string]{
	Flag: "subjects", Env: "KFN_RELAY_SUBJECTS",
	Usage: "comma-separated subjects the functions emit on (wildcards allowed); the event stream is created or extended to capture them",
}

func between(lo, hi int) func(int) error {
	return func(n int) error {
		if n < lo || n > hi {
			return fmt.Errorf("%d is out of range %d..%d", n, lo, hi)
		}
		return nil
	}
}

func atLeast(lo int) func(int) error {
	return func(n int) error {
		if n < lo {
			return fmt.Errorf("must be at least %d", lo)
		}
		return nil
	}
}

func positive[T int | time.Duration](v T) error {
	if v <= 0 {
		return errors.New("must be positive")
	}
	return nil
}

func notEmpty(s string) error {
	if s == "" {
		return errors.New("must not be empty")
	}
	return nil
}

// postgresURL accepts a postgres:// URL, a keyword/value connection string
// (host=… dbname=…; pgx checks its keys when it connects), or nothing (the
// command or the worker says what is missing).
func postgresURL(s string) error {
	if s == "" {
		return nil
	}
	if !strings.Contains(s, "://") && strings.Contains(s, "=") {
		return nil
	}
	u, err := url.Parse(s)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return fmt.Errorf("%q does not parse as a URL: %s", redact.Redact(s), redact.Scrub(err.Error(), s))
	}
	if u.Scheme != "postgres" && u.Scheme != "postgresql" {
		return fmt.Errorf("%q is not a postgres:// URL (nor a keyword/value string: host=… dbname=…)", redact.Redact(s))
	}
	return nil
}

// functionDatabases checks each FUNCTION=URL of --function-databases: a
// function named once, with a Postgres URL.
func functionDatabases(list []string) error {
	var errs []error
	seen := map[string]bool{}
	for _, item := range list {
		function, url, ok := strings.Cut(item, "=")
		function = strings.TrimSpace(function)
		switch {
		case !ok || function == "" || strings.TrimSpace(url) == "":
			errs = append(errs, fmt.Errorf("%q is not FUNCTION=URL", redact.Redact(item)))
		case seen[function]:
			errs = append(errs, fmt.Errorf("function %s is given twice", function))
		default:
			seen[function] = true
			if err := postgresURL(strings.TrimSpace(url)); err != nil {
				errs = append(errs, fmt.Errorf("function %s: %w", function, err))
			} else if strings.Contains(url, "=") && !strings.Contains(url, "://") {
				errs = append(errs, fmt.Errorf("function %s: give a postgres:// URL (a keyword/value string cannot be told from the list's = and ,)", function))
			}
		}
	}
	return errors.Join(errs...)
}

// hostPorts checks each broker: one error per broker that is not host:port.
func hostPorts(brokers []string) error {
	var errs []error
	for _, b := range brokers {
		host, port, err := net.SplitHostPort(b)
		if n, perr := strconv.Atoi(port); err != nil || host == "" || perr != nil || n < 1 || n > 65535 {
			errs = append(errs, fmt.Errorf("%q is not host:port", b))
		}
	}
	return errors.Join(errs...)
}

// Metrics (issue 12).

// DefaultStallAfter is StallAfter's default.
const DefaultStallAfter = 60 * time.Second

// StallAfter is how long a lane with lag may go without a commit before
// kfn_lanes_stalled counts it.
var StallAfter = Setting[time.Duration]{
	Flag: "stall-after", Env: "KFN_STALL_AFTER", Default: DefaultStallAfter,
	Usage: "a lane with lag and no commit for longer counts as stalled (kfn_lanes_stalled)",
}

// oauthExtensionKey reports whether k may name an OAUTHBEARER SASL
// extension: letters only (RFC 7628's key), and not "auth", the token's.
func oauthExtensionKey(k string) bool {
	if k == "" || k == "auth" {
		return false
	}
	for _, r := range k {
		if (r < 'a' || r > 'z') && (r < 'A' || r > 'Z') {
			return false
		}
	}
	return true
}

// oauthExtensionValue reports whether v may be an OAUTHBEARER SASL
// extension's value: not empty, printable ASCII, spaces and tabs (RFC
// 7628's value, as Kafka checks it).
func oauthExtensionValue(v string) bool {
	if v == "" {
		return false
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < 0x21 || c > 0x7e) && c != ' ' && c != '\t' {
			return false
		}
	}
	return true
}
