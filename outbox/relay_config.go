package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"
)

// RelayConfig configures a Relay. Zero fields take the defaults listed on
// each field (see WithDefaults); Pool, JetStream and Subjects are required.
type RelayConfig struct {
	// Pool is the Postgres pool holding kfn.outbox. The relay also opens one
	// extra connection of its own (with the pool's settings) to LISTEN for
	// new rows.
	Pool *pgxpool.Pool
	// JetStream is the stream's JetStream context. The relay looks up (or
	// creates) the stream through it, and publishes the events on its
	// connection (JetStream.Conn()) with core NATS, taking the stream's
	// acks on one subscription of its own: at most Shards × MaxInFlight
	// publishes are in flight per process.
	JetStream jetstream.JetStream

	// Stream is the JetStream stream the events land in. Default
	// DefaultStream.
	Stream string
	// Subjects are the subjects the stream captures; every outbox row's
	// subject must fall under one of them. Required. When the stream already
	// exists it is left alone, but its subjects must cover these.
	Subjects []string
	// Duplicates is the stream's duplicate window, used only when the relay
	// creates the stream. A republished event (after a relay crash between
	// the stream ack and the row delete) is dropped by JetStream inside this
	// window, and by the downstream inbox after it. Default 2m.
	Duplicates time.Duration
	// MaxAge bounds the stream the relay creates: events older than this are
	// removed. Used only when the relay creates the stream. Default 7 days
	// (DefaultStreamMaxAge).
	MaxAge time.Duration
	// Replicas is the number of replicas of the stream the relay creates.
	// Used only when the relay creates the stream. Default 1.
	Replicas int

	// BatchSize is how many rows one shard reads per query. Default 500.
	BatchSize int
	// MaxInFlight bounds a shard's unacknowledged publishes. Default 100.
	MaxInFlight int
	// PollInterval is how often an idle shard looks for rows while the
	// LISTEN connection is down. While it is up, commits wake their shards
	// at once and idle shards poll only every 10 × PollInterval, as a
	// safety net. Default 500ms.
	PollInterval time.Duration
	// Linger is how long a shard waits, after a batch smaller than
	// BatchSize, before it reads again: commits arriving meanwhile are read
	// together, which saves a query per commit at a steady rate. A shard
	// that keeps finding rows doubles its wait after each such batch, up to
	// MaxLinger, and goes back to Linger once a read finds nothing (an idle
	// shard that a notification wakes reads at once). Negative: no wait.
	// Defaults 5ms and 20ms.
	Linger    time.Duration
	MaxLinger time.Duration
	// AckTimeout is how long a publish may wait for its stream ack before it
	// counts as failed and is sent again. Default 5s.
	AckTimeout time.Duration
	// RetryMin and RetryMax bound the exponential backoff after a failed
	// publish or a failed Postgres query. Defaults 100ms and 5s.
	RetryMin time.Duration
	RetryMax time.Duration
	// MaxAttempts is how often an event the stream rejects (not an outage: an
	// error about the message itself, such as "message size exceeds maximum")
	// is tried before its key is parked. A parked key is skipped, with its
	// rows left in the outbox, for ParkFor; its later events wait behind it.
	// Defaults 5 and 30s.
	MaxAttempts int
	ParkFor     time.Duration

	// Logger receives the relay's logs. Default slog.Default().
	Logger *slog.Logger

	// Tracer, when set, records a "send <subject>" span per publish, from
	// the publish to its stream ack, continuing the trace context stored
	// with the event, and puts the span's context on the message, so the
	// consumer continues the trace from it. When nil, the stored trace
	// context is published as it is.
	Tracer trace.Tracer

	// Scheduler, when set, decides which shards this process relays: Run
	// hands it a function that works one shard until its ctx ends, so that N
	// relay processes can split the shards (kfn's workers do it with NATS
	// leases). When nil, Run works all shards.
	Scheduler ShardScheduler

	// Mode is where the functions write their events (--outbox). With
	// ModeWAL the relay reads the WAL outbox's replication slot (one reader
	// per slot, chosen by SlotLease) besides the table's shards, which may
	// still hold events written before a switch to wal. With ModeTable it
	// reads the slot too when the WAL outbox is set up, so that events
	// written before a switch back to table are relayed. Default ModeTable.
	Mode Mode
	// SlotLease, when set, decides when this process reads the slot, and
	// gives the fencing token that keeps an earlier reader off it. When
	// nil, the relay reads the slot all the time, unfenced: one relay only.
	SlotLease SlotLease
	// WorkerID names this relay in kfn.wal_outbox (the slot's reader).
	WorkerID string
	// MaxPending bounds the events read from the slot and not yet acked;
	// the relay stops reading while it has that many. Default 10000.
	MaxPending int
	// StatusInterval is how often the slot reader confirms its position to
	// Postgres and reports its backlog in kfn.wal_outbox. Default 1s.
	StatusInterval time.Duration

	// AfterAck, when set, is called by a shard loop for every event the
	// stream acked, with when the ack came (kfn bench measures commit → ack
	// latency with it). It runs on the shard's loop: it must not block.
	AfterAck func(eventID string, ackedAt time.Time)

	// publish, when set, sends the relay's messages instead of
	// (*nats.Conn).PublishMsg (tests make publishes fail with it).
	publish func(*nats.Conn, *nats.Msg) error
}

// ShardScheduler hands out relay shards (0 to Shards-1) to this process.
// Run calls work once per shard it hands out, in its own goroutine, and
// cancels the ctx it passes when the shard must stop; it returns when ctx
// ends.
type ShardScheduler interface {
	Run(ctx context.Context, work func(ctx context.Context, shard int)) error
}

// WithDefaults returns a copy of c with every unset field set to its default.
func (c RelayConfig) WithDefaults() RelayConfig {
	if c.Stream == "" {
		c.Stream = DefaultStream
	}
	if c.Duplicates == 0 {
		c.Duplicates = DefaultDuplicates
	}
	if c.MaxAge == 0 {
		c.MaxAge = DefaultStreamMaxAge
	}
	if c.BatchSize == 0 {
		c.BatchSize = 500
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 100
	}
	if c.PollInterval == 0 {
		c.PollInterval = 500 * time.Millisecond
	}
	if c.Linger == 0 {
		c.Linger = 5 * time.Millisecond
	}
	if c.MaxLinger == 0 {
		c.MaxLinger = max(c.Linger, 20*time.Millisecond)
	}
	if c.AckTimeout == 0 {
		c.AckTimeout = 5 * time.Second
	}
	if c.RetryMin == 0 {
		c.RetryMin = 100 * time.Millisecond
	}
	if c.RetryMax == 0 {
		c.RetryMax = 5 * time.Second
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 5
	}
	if c.ParkFor == 0 {
		c.ParkFor = 30 * time.Second
	}
	if c.Mode == "" {
		c.Mode = ModeTable
	}
	if c.MaxPending == 0 {
		c.MaxPending = 10000
	}
	if c.StatusInterval == 0 {
		c.StatusInterval = time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// RelayConfigError names the RelayConfig field that is wrong and why.
type RelayConfigError struct {
	Field   string
	Problem string
}

func (e *RelayConfigError) Error() string {
	return fmt.Sprintf("outbox relay config: %s %s", e.Field, e.Problem)
}

func (c RelayConfig) validate() error {
	bad := func(field, format string, args ...any) error {
		return &RelayConfigError{Field: field, Problem: fmt.Sprintf(format, args...)}
	}
	switch {
	case c.Pool == nil:
		return bad("Pool", "is required: pass the Postgres pool that holds kfn.outbox")
	case c.JetStream == nil:
		return bad("JetStream", "is required: pass jetstream.New(natsConn)")
	case !validStreamName(c.Stream):
		return bad("Stream", "%q is not a valid stream name: use letters, digits, '-' and '_' only", c.Stream)
	case len(c.Subjects) == 0:
		return bad("Subjects", "is required: list the subjects the outbox events are published on, e.g. \"orders.>\"")
	case c.Duplicates < 0:
		return bad("Duplicates", "is %v: the duplicate window must be positive", c.Duplicates)
	case c.MaxAge < 0:
		return bad("MaxAge", "is %v: the stream's max age must be positive", c.MaxAge)
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return bad("BatchSize", "is %d: use 1 to 10000", c.BatchSize)
	case c.MaxInFlight < 1:
		return bad("MaxInFlight", "is %d: allow at least one in-flight publish", c.MaxInFlight)
	case c.PollInterval <= 0:
		return bad("PollInterval", "is %v: it must be positive", c.PollInterval)
	case c.Linger > 0 && c.MaxLinger < c.Linger:
		return bad("MaxLinger", "is %v: it must be at least Linger (%v)", c.MaxLinger, c.Linger)
	case c.AckTimeout <= 0:
		return bad("AckTimeout", "is %v: it must be positive", c.AckTimeout)
	case c.RetryMin <= 0 || c.RetryMax < c.RetryMin:
		return bad("RetryMin/RetryMax", "are %v/%v: both must be positive and RetryMin <= RetryMax", c.RetryMin, c.RetryMax)
	case c.MaxAttempts < 1:
		return bad("MaxAttempts", "is %d: it must be at least 1", c.MaxAttempts)
	case c.ParkFor <= 0:
		return bad("ParkFor", "is %v: it must be positive", c.ParkFor)
	case c.Mode != ModeTable && c.Mode != ModeWAL:
		return bad("Mode", "is %q: use ModeTable or ModeWAL", c.Mode)
	case c.MaxPending < 1:
		return bad("MaxPending", "is %d: allow at least one pending event", c.MaxPending)
	case c.StatusInterval <= 0:
		return bad("StatusInterval", "is %v: it must be positive", c.StatusInterval)
	}
	for i, s := range c.Subjects {
		if err := CheckSubjectPattern(s); err != nil {
			return bad(fmt.Sprintf("Subjects[%d]", i), "%v", err)
		}
	}
	return nil
}

func validStreamName(name string) bool {
	if name == "" || len(name) > 255 {
		return false
	}
	return !strings.ContainsAny(name, " \t\r\n.*>/\\")
}
