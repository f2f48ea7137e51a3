package preflight

import (
	"errors"
	"fmt"
	"time"

	"github.com/kfn-dev/kfn/internal/authorlink"
	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/internal/observe"
	"github.com/kfn-dev/kfn/internal/settings"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// link reaches what package runtime keeps unexported: where a Config was
// bound, and how its settings bind to flags.
var link = authorlink.Get[kfn.Config, kfn.KafkaSecurity, kfn.NATSSecurity, kfn.Record, kfn.Event, kfn.Events, kfn.BatchEvents]()

// BindConfig binds every setting of c to b (Config.Bind); b's errors are
// c's, reported by ValidateConfig.
func BindConfig(b *settings.Binder, c *kfn.Config) { link.BindConfig(b, c) }

// and a function binary's -h show their values.
const (
	DefaultBatchSize      = settings.DefaultBatchSize
	DefaultBatchWait      = settings.DefaultBatchWait
	DefaultMaxRecordBytes = settings.DefaultMaxRecordBytes
	DefaultBatchMaxBytes  = settings.DefaultBatchMaxBytes
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

// ConfigErrorOf is a ConfigError about setting s.
func ConfigErrorOf[T any](s settings.Setting[T], msg string, args ...any) *ConfigError {
	return &ConfigError{Field: s.Flag, Env: s.Env, Msg: fmt.Sprintf(msg, args...)}
}

// ValidateConfig checks every setting of c; Kafka brokers are required only
// when a function reads Kafka (needKafka). A value given to Bind that was
// rejected is reported as given, and not again as missing: its field kept
// the default.
func ValidateConfig(c kfn.Config, needKafka bool) error {
	var errs []error
	add := func(problems []*settings.Error) {
		for _, e := range problems {
			errs = append(errs, &ConfigError{Field: e.Flag, Env: e.Env, Msg: e.Msg})
		}
	}
	bad := func(err *ConfigError) { errs = append(errs, err) }
	rejected := map[string]bool{}
	if bound := link.BoundConfig(c); bound != nil {
		given := bound.Errors()
		for _, e := range given {
			rejected[e.Flag] = true
		}
		add(given)
	}
	if needKafka && len(c.KafkaBrokers) == 0 && !rejected[settings.KafkaBrokers.Flag] {
		bad(ConfigErrorOf(settings.KafkaBrokers, "no Kafka broker given: set it to host:port[,host:port…]"))
	}
	add(settings.KafkaBrokers.Problems(c.KafkaBrokers))
	if needKafka {
		for _, e := range kafkaconn.Problems(c.KafkaSecurity) {
			if !rejected[e.Flag] {
				add([]*settings.Error{e})
			}
		}
	}
	if c.DatabaseURL == "" && !rejected[settings.DatabaseURL.Flag] {
		bad(ConfigErrorOf(settings.DatabaseURL, "no Postgres URL given: set it to postgres://user@host:port/db"))
	}
	add(settings.DatabaseURL.Problems(c.DatabaseURL))
	if c.NATSURL == "" {
		bad(ConfigErrorOf(settings.NATSURL, "no NATS URL given: set it to nats://host:port"))
	}
	var badNATS *connect.SettingError
	if err := connect.CheckNATS(c.NATSSecurity); errors.As(err, &badNATS) && !rejected[badNATS.Flag] {
		bad(&ConfigError{Field: badNATS.Flag, Env: badNATS.Env, Msg: badNATS.Msg})
	}
	add(settings.NATSReplicas.Problems(c.NATSReplicas))
	// BatchWait: any value goes, a negative one is no wait.
	add(settings.BatchSize.Problems(c.BatchSize))
	add(settings.BatchMaxBytes.Problems(c.BatchMaxBytes))
	add(settings.MaxRecordBytes.Problems(c.MaxRecordBytes))
	add(settings.RetryAttempts.Problems(c.RetryAttempts))
	add(settings.RetryInitial.Problems(c.RetryInitial))
	if c.RetryInitial > 0 && c.RetryMax < c.RetryInitial {
		bad(ConfigErrorOf(settings.RetryMax, "must be at least --retry-initial (%s)", c.RetryInitial))
	}
	add(settings.HandlerTimeout.Problems(c.HandlerTimeout))
	add(settings.StartFrom.Problems(c.StartFrom))
	add(settings.EventDedup.Problems(c.EventDedup))
	add(settings.Outbox.Problems(c.Outbox))
	if c.EventRetention < c.EventDedup {
		bad(ConfigErrorOf(settings.EventRetention, "%s is shorter than --event-dedup (%s)", c.EventRetention, c.EventDedup))
	}
	add(settings.InboxRetention.Problems(c.InboxRetention))
	add(settings.Lanes.Problems(c.Lanes))
	add(settings.KeyConcurrency.Problems(c.KeyConcurrency))
	add(settings.LeaseRenew.Problems(c.LeaseRenew))
	if c.LeaseRenew > 0 && c.LeaseTTL < 3*c.LeaseRenew {
		bad(ConfigErrorOf(settings.LeaseTTL, "%s must be at least 3 × --lease-renew (%s) so a lease survives a missed renewal", c.LeaseTTL, c.LeaseRenew))
	}
	rt := observe.RoundTripLimit(c.StatementTimeout)
	switch tooShort := settings.StatementTimeout.Problems(c.StatementTimeout); {
	case len(tooShort) > 0:
		add(tooShort)
	case rt > lease.Validity(c.LeaseTTL):
		bad(ConfigErrorOf(settings.StatementTimeout, "%s is too long for --lease-ttl %s: a round trip unanswered for 5/4 of it (%s) is a frozen connection, and the worker must notice one within the %s (0.7 × --lease-ttl) that a lease stays valid without renewal; lower --statement-timeout to at most %s or raise --lease-ttl to at least %s",
			c.StatementTimeout, c.LeaseTTL, rt, lease.Validity(c.LeaseTTL), lease.Validity(c.LeaseTTL)*4/5, (c.StatementTimeout * 5 / 4 * 10 / 7).Round(time.Millisecond)))
	case c.HandlerTimeout > 0 && rt > c.HandlerTimeout:
		bad(ConfigErrorOf(settings.HandlerTimeout, "%s is shorter than 5/4 of --statement-timeout (%s): a slow statement in a handler must be cancelled by Postgres (the record's error, retried and then dead-lettered) before the handler's deadline closes the connection (an infrastructure error, retried forever); raise --handler-timeout to at least %s or lower --statement-timeout to at most %s",
			c.HandlerTimeout, c.StatementTimeout, rt, c.HandlerTimeout*4/5))
	}
	return errors.Join(errs...)
}
