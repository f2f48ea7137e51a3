package settings

// Table is every setting of declared.go, in groups, in the order the
// configuration reference (docs/reference/configuration.md, written by
// cmd/kfn/internal/docgen) lists them. TestTableListsEverySetting fails
// when a declared setting is missing from it.
var Table = []Group{
	{Name: "Connections", Settings: []Described{
		DatabaseURL, FunctionDatabases, NATSURL, NATSCreds, NATSTokenFile, NATSNKey, NATSCA, NATSCert, NATSKey,
		NATSReplicas, NATSProvisioned, KafkaBrokers, LeaseBucket, EventStream, Outbox,
	}},
	{Name: "Kafka security", Settings: []Described{
		KafkaTLS, KafkaCA, KafkaCert, KafkaKey, KafkaServerName,
		KafkaSASLMechanism, KafkaSASLUser, KafkaSASLPasswordFile,
		KafkaOAuthTokenURL, KafkaOAuthClientID, KafkaOAuthClientSecretFile, KafkaOAuthScopes,
		KafkaOAuthTokenFile, KafkaOAuthExtensions,
	}},
	{Name: "Workers", Settings: []Described{
		WorkerID, BatchSize, BatchMaxBytes, BatchWait, MaxRecordBytes, RetryAttempts, RetryInitial, RetryMax,
		HandlerTimeout, StatementTimeout, StartFrom, ConsumerGroup, LeaseTTL, LeaseRenew, Lanes, KeyConcurrency,
		NoRelay, SkipSetup, EventDedup, EventRetention, InboxRetention, DeadLetterRetention,
		LogLevel, MetricsAddr, StallAfter,
	}},
	{Name: "Relay", Settings: []Described{RelaySubjects}},
}

// Variables are the environment variables kfn reads that have no flag.
var Variables = []Variable{
	{KafkaSASLPasswordEnv, "the SASL password for Kafka, wherever the Kafka security settings apply; never a flag, so that it does not show in a process list (or name a file with --kafka-sasl-password-file)"},
	{KafkaOAuthClientSecretEnv, "the OAuth client secret of --kafka-oauth-client-id (OAUTHBEARER); never a flag (or name a file with --kafka-oauth-client-secret-file)"},
	{OTelSDKDisabledEnv, `"true": a worker or kfn relay exports no traces`},
	{OTelTracesExporterEnv, `"otlp" turns the export of traces on, "console" writes them on stdout, "none" turns it off`},
	{OTelEndpointEnv, "the OTLP base URL of the collector traces are exported to (http://host:4318 for http/protobuf, http://host:4317 for grpc); setting it turns the export on"},
	{OTelTracesEndpointEnv, "the full URL traces are exported to; setting it turns the export on"},
	{OTelProtocolEnv, "the OTLP protocol: http/protobuf (default) or grpc"},
	{OTelTracesProtocolEnv, "the OTLP protocol of traces: http/protobuf (default) or grpc; wins over " + OTelProtocolEnv},
	{OTelResourceAttributes, "key=value,… attributes of the traces' resource (the OpenTelemetry SDK reads the other OTEL_* variables itself, such as OTEL_SERVICE_NAME)"},
}

// Group is a heading of Table and its settings.
type Group struct {
	Name     string
	Settings []Described
}

// Variable is an environment variable without a flag.
type Variable struct {
	Name  string
	Usage string
}

// Described is a Setting of any type.
type Described interface {
	Describe() Description
}

// Description is a setting as the configuration reference shows it.
type Description struct {
	Flag    string // without dashes
	Env     string // its variable
	OldEnv  string // a former name of the variable, still read; "" if none
	FileEnv string // a Secret setting's variable that names a file holding it; "" if none
	Type    string // string, list, int, duration, or "" for bool
	Default string // as -h shows it; "" for none
	Usage   string
}

// Describe returns s as the configuration reference shows it.
func (s Setting[T]) Describe() Description {
	v := &value[T]{s: s}
	d := Description{Flag: s.Flag, Env: s.Env, OldEnv: s.OldEnv, Type: v.typeName(), Default: v.shownDefault(), Usage: s.Usage}
	if s.Secret {
		d.FileEnv = s.FileEnv()
	}
	return d
}
