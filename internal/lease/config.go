package lease

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"time"
)

// Defaults. With them another member takes over a dead holder's leases
// 5–6.3 s after its last renewal (measured: 5.2–5.3 s after its connection
// closed), and a released lease within milliseconds. See the package
// documentation for the timing argument.
const (
	// DefaultBucket is the JetStream KV bucket that holds leases and
	// membership heartbeats.
	DefaultBucket = "kfn_leases"
	// DefaultTTL is the bucket's MaxAge: how long an unrenewed lease or
	// heartbeat stays in the bucket. nats-server 2.15 removes an expired key
	// 0.04–0.35 s after TTL (measured), never before.
	DefaultTTL = 5 * time.Second
	// DefaultRenewEvery is how often a holder renews its leases and
	// heartbeat.
	DefaultRenewEvery = time.Second
	// DefaultSafetyMargin is SafetyMarginFor(DefaultTTL): a holder whose
	// renewals keep failing stops using its lease 3.5 s after the last
	// successful renewal was sent.
	DefaultSafetyMargin = DefaultTTL * safetyMarginPercent / 100
	// DefaultPollItemsEvery is how often the Manager asks for the item list.
	DefaultPollItemsEvery = 3 * time.Second
	// DefaultTokenMargin is how far above every token it knows of a newly
	// created bucket starts its revisions. It covers the revisions a lost
	// bucket may have issued after the last one its creator knew of; see
	// "Bucket lost" in the package documentation.
	DefaultTokenMargin uint64 = 1 << 32
)

// MinTTL is the smallest TTL accepted. Below it the server's expiry
// granularity (a timer of at least 250 ms) and its 1 s minimum for expiry
// markers dominate.
const MinTTL = time.Second

var bucketNameRe = regexp.MustCompile(`^[a-zA-Z0-9_-]+$`)

// StoreConfig configures a Store: the bucket and the timing that every member
// using the bucket must agree on.
type StoreConfig struct {
	// Bucket is the JetStream KV bucket name. Default DefaultBucket.
	Bucket string
	// TTL is the bucket's MaxAge. Every user of a bucket must use the same
	// TTL; OpenStore refuses a bucket created with another. Default
	// DefaultTTL, at least MinTTL.
	TTL time.Duration
	// SafetyMargin is how long before TTL a holder considers its lease lost,
	// counted from when its last successful write was sent. Must be > 0 and
	// < TTL. Default DefaultSafetyMargin.
	SafetyMargin time.Duration
	// Logger receives warnings about the bucket. Default slog.Default().
	Logger *slog.Logger
	// TokenFloor, if set, returns the largest token the work has stored
	// (for kfn: the largest epoch in Postgres). It is called only when the
	// bucket has to be created, and the bucket's revisions then start above
	// it plus TokenMargin, so that tokens stay larger than every token used
	// before, even after the bucket was lost. An error leaves the bucket
	// uncreated (and is retried); nil counts as 0.
	TokenFloor func(ctx context.Context) (uint64, error)
	// TokenMargin is added to the floor when a bucket is created. Default
	// DefaultTokenMargin.
	TokenMargin uint64
	// Replicas is the number of replicas of the bucket's stream when this
	// Store creates it (3 on a NATS cluster survives the loss of a server).
	// An existing bucket with another number is refused with a
	// *ReplicasError, never changed. Default 1.
	Replicas int
	// NoCreate: the bucket was made beforehand (kfn: `kfn migrate --nats`)
	// and this Store never creates it, not even again after it was lost: a
	// missing bucket is an error wrapping jetstream.ErrBucketNotFound. For
	// NATS users without the right to create streams.
	NoCreate bool
}

// WithDefaults returns a copy of c with every zero field set to its default.
func (c StoreConfig) WithDefaults() StoreConfig {
	if c.Bucket == "" {
		c.Bucket = DefaultBucket
	}
	if c.TTL == 0 {
		c.TTL = DefaultTTL
	}
	if c.SafetyMargin == 0 {
		c.SafetyMargin = SafetyMarginFor(c.TTL)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.TokenMargin == 0 {
		c.TokenMargin = DefaultTokenMargin
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	return c
}

func (c StoreConfig) validate() error {
	if !bucketNameRe.MatchString(c.Bucket) {
		return fmt.Errorf("lease config: Bucket %q must be non-empty and use only letters, digits, '-' and '_'", c.Bucket)
	}
	if c.TTL < MinTTL {
		return fmt.Errorf("lease config: TTL %v is below the minimum %v", c.TTL, MinTTL)
	}
	if c.SafetyMargin <= 0 || c.SafetyMargin >= c.TTL {
		return fmt.Errorf("lease config: SafetyMargin %v must be > 0 and < TTL (%v)", c.SafetyMargin, c.TTL)
	}
	if c.Replicas < 1 || c.Replicas > 5 {
		return fmt.Errorf("lease config: Replicas %d must be between 1 and 5", c.Replicas)
	}
	return nil
}

// Config configures a Manager.
type Config struct {
	// Bucket is the JetStream KV bucket name. Default DefaultBucket.
	Bucket string
	// Group names the set of items and members, for example
	// "orders-fn/orders" for the partitions of one function's topic, or
	// "relay" for outbox relay shards. Required.
	Group string
	// MemberID identifies this member in the group and is written as the
	// owner of its leases. It must be unique among live members. Default:
	// the host name plus a random suffix.
	MemberID string
	// TTL is the bucket's MaxAge; see StoreConfig.TTL. Default DefaultTTL.
	TTL time.Duration
	// RenewEvery is the period of lease renewals and heartbeats. It must be
	// at most (TTL-SafetyMargin)/2, so that one failed renewal never loses a
	// lease. Default DefaultRenewEvery.
	RenewEvery time.Duration
	// SafetyMargin; see StoreConfig.SafetyMargin. Default
	// DefaultSafetyMargin.
	SafetyMargin time.Duration
	// PollItemsEvery is how often Run calls items; it is also called on
	// every membership change. Default DefaultPollItemsEvery.
	PollItemsEvery time.Duration
	// Logger is the structured logger. Default slog.Default().
	Logger *slog.Logger
	// TokenFloor and TokenMargin; see StoreConfig. Every member of a bucket
	// should give the same TokenFloor, since whichever member notices a lost
	// bucket first creates it again.
	TokenFloor  func(ctx context.Context) (uint64, error)
	TokenMargin uint64
	// Replicas and NoCreate; see StoreConfig.
	Replicas int
	NoCreate bool
	// Healthy, if set, reports whether this member can do the work of its
	// claims now (for kfn: whether it reaches Postgres); nil means always.
	// It must be cheap and must not block: the Manager calls it every
	// RenewEvery, before every renewal and before acquiring. While it
	// returns an error the member steps out: it deletes its heartbeat and
	// writes none, so that the other members take its items over; it
	// acquires nothing; it renews no lease and cancels every claim's work
	// (the error is the cause), then releases each lease as soon as its work
	// returns, so that a healthy member takes the item at once rather than
	// after TTL. Once it returns nil again the member rejoins.
	Healthy func() error
}

// WithDefaults returns a copy of c with every zero field set to its default.
// The bucket's settings take StoreConfig's defaults.
func (c Config) WithDefaults() Config {
	sc := c.storeConfig().WithDefaults()
	c.Bucket, c.TTL, c.SafetyMargin, c.Logger, c.TokenMargin, c.Replicas = sc.Bucket, sc.TTL, sc.SafetyMargin, sc.Logger, sc.TokenMargin, sc.Replicas
	if c.MemberID == "" {
		c.MemberID = defaultMemberID()
	}
	if c.RenewEvery == 0 {
		c.RenewEvery = DefaultRenewEvery
	}
	if c.PollItemsEvery == 0 {
		c.PollItemsEvery = DefaultPollItemsEvery
	}
	return c
}

func (c Config) storeConfig() StoreConfig {
	return StoreConfig{Bucket: c.Bucket, TTL: c.TTL, SafetyMargin: c.SafetyMargin, Logger: c.Logger,
		TokenFloor: c.TokenFloor, TokenMargin: c.TokenMargin, Replicas: c.Replicas, NoCreate: c.NoCreate}
}

func (c Config) validate() error {
	if err := c.storeConfig().validate(); err != nil {
		return err
	}
	if c.Group == "" {
		return fmt.Errorf("lease config: Group is required")
	}
	if c.MemberID == "" {
		return fmt.Errorf("lease config: MemberID is required")
	}
	if limit := (c.TTL - c.SafetyMargin) / 2; c.RenewEvery <= 0 || c.RenewEvery > limit {
		return fmt.Errorf("lease config: RenewEvery %v must be > 0 and at most (TTL-SafetyMargin)/2 = %v", c.RenewEvery, limit)
	}
	if c.PollItemsEvery <= 0 {
		return fmt.Errorf("lease config: PollItemsEvery %v must be > 0", c.PollItemsEvery)
	}
	return nil
}

func defaultMemberID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "member"
	}
	var b [3]byte
	_, _ = rand.Read(b[:])
	return host + "-" + hex.EncodeToString(b[:])
}

// The timing rule of a lease, in one place: a holder gives its lease up
// SafetyMargin before TTL after its last successful renewal was sent, so it
// stops before the server can expire the lease and anyone else can acquire
// it. Unless configured otherwise, the margin is 30% of the TTL.
const safetyMarginPercent = 30

// SafetyMarginFor is the default safety margin for a TTL: 30% of it.
func SafetyMarginFor(ttl time.Duration) time.Duration { return ttl * safetyMarginPercent / 100 }

// Validity is how long a lease with this TTL and the default safety margin
// stays usable after its last successful renewal was sent: TTL −
// SafetyMarginFor(TTL), 0.7 × TTL.
func Validity(ttl time.Duration) time.Duration { return ttl - SafetyMarginFor(ttl) }
