package lease

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kfn-dev/kfn/internal/repeatlog"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Store reads and writes the leases and membership heartbeats kept in one
// JetStream KV bucket. It holds no per-lease state: a Lease value carries
// that. A Store is safe for concurrent use.
type Store struct {
	js  jetstream.JetStream
	kv  jetstream.KeyValue
	cfg StoreConfig
	log *slog.Logger
	now func() time.Time // time.Now; a test moves it
	// repeats logs its retried failures once per step (package repeatlog).
	repeats *repeatlog.Log

	// maxSeen is the largest revision this Store has written or read. When
	// the bucket is lost, it is the best knowledge of how far the lost
	// bucket's revisions went.
	maxSeen atomic.Uint64

	mu sync.Mutex
	// created identifies the bucket instance last seen: the creation time of
	// its stream. A bucket deleted and created again has another.
	created time.Time
	// quietUntil is when the holders of a lost bucket have all stopped, at
	// the latest: TTL-SafetyMargin after this Store noticed the loss.
	// Acquires wait until then.
	quietUntil time.Time
}

// Stream metadata a Store writes when it creates the bucket.
const (
	// metaTokenBase is the base of the bucket's tokens: its stream's first
	// sequence is base+1, so every revision, and so every token, is above it.
	metaTokenBase = "kfn_token_base"
	// metaTokenFloor and metaTokenSeen say where the base came from: the
	// largest token the work had stored, and the largest revision the
	// creating Store had seen.
	metaTokenFloor = "kfn_token_floor"
	metaTokenSeen  = "kfn_token_seen"
)

// maxTokenBase keeps tokens inside a signed 64-bit integer (Postgres bigint)
// with room for 2^62 more revisions.
const maxTokenBase = math.MaxInt64 / 2

// OpenStore opens the bucket, or creates it if it does not exist, and checks
// that its TTL matches cfg.TTL. A bucket it creates starts its revisions
// above cfg.TokenFloor plus cfg.TokenMargin.
func OpenStore(ctx context.Context, js jetstream.JetStream, cfg StoreConfig) (*Store, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Store{js: js, cfg: cfg, log: cfg.Logger.With("bucket", cfg.Bucket), now: time.Now, repeats: repeatlog.New()}
	kv, err := s.openBucket(ctx)
	for settled := time.Now().Add(openSettle); unanswered(err) && time.Now().Before(settled); {
		// A JetStream cluster that has just started (or lost a node)
		// answers no request about streams until its meta leader is
		// elected: seconds. Workers started with it wait, not exit.
		s.repeats.Failed(ctx, s.log, slog.LevelWarn, "JetStream did not answer about the lease bucket in time; retrying", "err", err)
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(500 * time.Millisecond):
		}
		kv, err = s.openBucket(ctx)
	}
	if err != nil {
		return nil, err
	}
	s.kv = kv
	return s, nil
}

// openSettle bounds how long OpenStore retries while JetStream does not
// answer (a cluster electing its leaders), before it reports the error.
const openSettle = 30 * time.Second

// unanswered reports whether err is a JetStream request that got no
// answer in time, and only that: a refused request or a missing bucket is
// not retried.
func unanswered(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout)
}

// Config returns the store's configuration, defaults applied.
func (s *Store) Config() StoreConfig { return s.cfg }

// openBucket opens the bucket, creating it if it does not exist. It is also
// how a lost bucket is created again.
func (s *Store) openBucket(ctx context.Context) (jetstream.KeyValue, error) {
	kv, err := s.openExisting(ctx)
	if !errors.Is(err, jetstream.ErrBucketNotFound) || s.cfg.NoCreate {
		return kv, err
	}
	return s.createBucket(ctx)
}

// openExisting opens the bucket if it exists and checks its TTL, on which
// the safety argument rests. The error wraps jetstream.ErrBucketNotFound if
// it does not exist.
func (s *Store) openExisting(ctx context.Context) (jetstream.KeyValue, error) {
	kv, err := s.js.KeyValue(ctx, s.cfg.Bucket)
	if err != nil {
		return nil, fmt.Errorf("open lease bucket %s: %w", s.cfg.Bucket, err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("read lease bucket %s status: %w", s.cfg.Bucket, err)
	}
	if st.TTL() != s.cfg.TTL {
		return nil, fmt.Errorf("lease bucket %s has TTL %v but TTL is configured as %v: every member of a bucket must use the same TTL (use another Bucket, or delete the bucket when no worker runs)",
			s.cfg.Bucket, st.TTL(), s.cfg.TTL)
	}
	if bs, ok := st.(*jetstream.KeyValueBucketStatus); ok && bs.StreamInfo() != nil && bs.StreamInfo().Config.Replicas != s.cfg.Replicas {
		return nil, &ReplicasError{Stream: bs.StreamInfo().Config.Name, Have: bs.StreamInfo().Config.Replicas, Want: s.cfg.Replicas}
	}
	s.noteBucket(st)
	return kv, nil
}

// ReplicasError is an existing stream (a lease bucket's, or kfn's event
// stream) with another number of replicas than configured. kfn never
// changes it: scaling a stream is an operator's decision.
type ReplicasError struct {
	Stream     string
	Have, Want int
}

func (e *ReplicasError) Error() string {
	return fmt.Sprintf("stream %s has %d replicas, not the %d configured: kfn does not change an existing stream; configure %d, or change the stream (nats stream edit %s --replicas %d)",
		e.Stream, e.Have, e.Want, e.Have, e.Stream, e.Want)
}

// createBucket creates the bucket with its revisions starting above every
// token known: the work's stored tokens (TokenFloor) and the revisions this
// Store has seen, plus TokenMargin. When several members create it at once,
// the first creation wins and the others open that bucket, whatever base it
// has: creation is atomic on the server, and every base is safe.
func (s *Store) createBucket(ctx context.Context) (jetstream.KeyValue, error) {
	floor, err := s.tokenFloor(ctx)
	if err != nil {
		return nil, err
	}
	seen := s.maxSeen.Load()
	waited := false
	if seen == 0 && floor > 0 {
		// Tokens were used, so a bucket was lost, and this process never
		// saw it. Members that did see it notice the loss within two
		// RenewEvery and create it with what they saw; let them. Meanwhile
		// every holder of the lost bucket that is not paused stores its
		// token or gives it up, so the floor read again covers it.
		wait := s.cfg.TTL - s.cfg.SafetyMargin
		s.log.Warn("lease bucket is missing and this process never saw it: waiting for members that did, and for the lost leases to run out", "wait", wait)
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("create lease bucket %s: %w", s.cfg.Bucket, ctx.Err())
		case <-time.After(wait):
		}
		if kv, err := s.openExisting(ctx); !errors.Is(err, jetstream.ErrBucketNotFound) {
			return kv, err
		}
		if floor, err = s.tokenFloor(ctx); err != nil {
			return nil, err
		}
		waited = true
	}
	base := max(floor, seen) + s.cfg.TokenMargin
	if base > maxTokenBase || base < s.cfg.TokenMargin {
		return nil, fmt.Errorf("create lease bucket %s: token base %d (floor %d, seen %d, margin %d) leaves no room for tokens in a signed 64-bit integer",
			s.cfg.Bucket, base, floor, seen, s.cfg.TokenMargin)
	}
	markers := true
	if info, err := s.js.AccountInfo(ctx); err != nil {
		return nil, fmt.Errorf("create lease bucket %s: %w", s.cfg.Bucket, err)
	} else if info.API.Level < 1 {
		s.log.Warn("server does not support KV expiry markers; expiries are noticed by re-listing only")
		markers = false
	}
	scfg := s.streamConfig(markers)
	scfg.FirstSeq = base + 1
	scfg.Metadata = map[string]string{
		metaTokenBase:  strconv.FormatUint(base, 10),
		metaTokenFloor: strconv.FormatUint(floor, 10),
		metaTokenSeen:  strconv.FormatUint(seen, 10),
	}
	_, err = s.js.CreateStream(ctx, scfg)
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		// Another member created it first (or it exists with another
		// configuration): use it if its TTL is ours.
		return s.openCreated(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("create lease bucket %s: %w", s.cfg.Bucket, err)
	}
	s.log.Info("created lease bucket", "token_base", base, "token_floor", floor, "max_revision_seen", seen)
	if (floor > 0 || seen > 0) && !waited {
		// Tokens were used before, so this bucket replaces a lost one,
		// whose holders may still be inside their validity.
		s.startQuiet()
	}
	return s.openCreated(ctx)
}

// openCreated opens a bucket that was just created, by this Store or
// another. On a NATS cluster the server that answers may not know a
// stream created a moment ago through another (seen: "bucket not found"
// right after the create), so that answer is taken again for a while.
func (s *Store) openCreated(ctx context.Context) (jetstream.KeyValue, error) {
	deadline := time.Now().Add(openCreatedWait)
	for {
		kv, err := s.openExisting(ctx)
		if !errors.Is(err, jetstream.ErrBucketNotFound) || time.Now().After(deadline) {
			return kv, err
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("open lease bucket %s just created: %w", s.cfg.Bucket, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// openCreatedWait bounds how long openCreated waits for a new bucket to
// be known.
const openCreatedWait = 5 * time.Second

// tokenFloor asks the TokenFloor hook, if any.
func (s *Store) tokenFloor(ctx context.Context) (uint64, error) {
	if s.cfg.TokenFloor == nil {
		return 0, nil
	}
	floor, err := s.cfg.TokenFloor(ctx)
	if err != nil {
		return 0, fmt.Errorf("create lease bucket %s: read the token floor (the largest token stored): %w", s.cfg.Bucket, err)
	}
	return floor, nil
}

// startQuiet makes acquires wait until every holder of a lost bucket has
// stopped. Each holder stops TTL-SafetyMargin after its last successful
// renewal, which it sent before the bucket was lost, so before now.
func (s *Store) startQuiet() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.quietUntil = time.Now().Add(s.cfg.TTL - s.cfg.SafetyMargin)
}

// QuietUntil returns when acquires stop waiting for the holders of a lost
// bucket; zero or past when they do not wait.
func (s *Store) QuietUntil() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.quietUntil
}

// checkFresh checks that the bucket is the instance this Store knows, and
// returns an error wrapping ErrBucketNew while acquires must wait for the
// holders of a lost bucket (noticed now or before) to stop.
func (s *Store) checkFresh(ctx context.Context) error {
	if _, err := s.bucketReplaced(ctx); err != nil {
		return err
	}
	if until := s.QuietUntil(); time.Now().Before(until) {
		return fmt.Errorf("%w (for another %v)", ErrBucketNew, time.Until(until).Round(time.Millisecond))
	}
	return nil
}

// streamConfig is the configuration of the bucket's stream: the layout of a
// JetStream KV bucket (as jetstream.CreateKeyValue makes it, which a test
// checks) with History 1, MaxAge TTL and, if markers, expiry markers that
// let watchers see a key expire. CreateKeyValue cannot set the first
// sequence, so the Store creates the stream itself.
func (s *Store) streamConfig(markers bool) jetstream.StreamConfig {
	cfg := jetstream.StreamConfig{
		Name:              "KV_" + s.cfg.Bucket,
		Description:       "kfn leases and membership heartbeats (internal/lease)",
		Subjects:          []string{"$KV." + s.cfg.Bucket + ".>"},
		MaxMsgsPerSubject: 1, // History 1: only the latest write of a key
		MaxAge:            s.cfg.TTL,
		MaxBytes:          -1,
		MaxMsgs:           -1,
		MaxMsgSize:        -1,
		MaxConsumers:      -1,
		Storage:           jetstream.FileStorage,
		Replicas:          s.cfg.Replicas,
		Discard:           jetstream.DiscardNew,
		AllowRollup:       true, // purges of a key roll it up
		DenyDelete:        true, // keys are deleted with markers, not by sequence
		AllowDirect:       true, // Get answered by any replica
		Duplicates:        min(2*time.Minute, s.cfg.TTL),
	}
	if markers {
		cfg.AllowMsgTTL = true
		cfg.SubjectDeleteMarkerTTL = s.cfg.TTL
	}
	return cfg
}

// noteBucket records the identity of the bucket instance st describes, and
// reports whether it differs from the one seen before (the bucket was
// deleted and created again).
func (s *Store) noteBucket(st jetstream.KeyValueStatus) bool {
	bs, ok := st.(*jetstream.KeyValueBucketStatus)
	if !ok || bs.StreamInfo() == nil {
		return false
	}
	created := bs.StreamInfo().Created
	s.mu.Lock()
	changed := !s.created.IsZero() && !created.Equal(s.created)
	s.created = created
	s.mu.Unlock()
	if changed {
		s.startQuiet()
	}
	return changed
}

// bucketReplaced reports whether the bucket now in the server is another
// instance than the one this Store saw last: it was lost and created again,
// by this Store or another. Watches on the old instance see nothing more.
func (s *Store) bucketReplaced(ctx context.Context) (bool, error) {
	st, err := s.kv.Status(ctx)
	if err != nil {
		return false, err
	}
	return s.noteBucket(st), nil
}

// noteRevision records a revision read from or written to the bucket.
func (s *Store) noteRevision(rev uint64) {
	for {
		cur := s.maxSeen.Load()
		if rev <= cur || s.maxSeen.CompareAndSwap(cur, rev) {
			return
		}
	}
}

// TokenBase returns the base of the bucket's tokens: every revision, and so
// every token, is above it. Buckets created before bases existed have
// base 0.
func (s *Store) TokenBase(ctx context.Context) (uint64, error) {
	st, err := s.kv.Status(ctx)
	if err != nil {
		return 0, fmt.Errorf("read lease bucket %s status: %w", s.cfg.Bucket, err)
	}
	v, ok := st.Metadata()[metaTokenBase]
	if !ok {
		return 0, nil
	}
	base, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("lease bucket %s: metadata %s=%q is not a number", s.cfg.Bucket, metaTokenBase, v)
	}
	return base, nil
}

// recreateIfMissing creates the bucket again when the server answers that it
// does not exist: it was deleted, or a server restarted without its store.
// The new bucket's revisions start above every token stored and seen (see
// createBucket), so fencing goes on without anyone resetting epochs. It
// reports whether the bucket is another instance than the one seen before:
// created again now, by this Store or, a moment earlier, by another.
func (s *Store) recreateIfMissing(ctx context.Context) (bool, error) {
	_, err := s.js.KeyValue(ctx, s.cfg.Bucket)
	if err == nil {
		return s.bucketReplaced(ctx)
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return false, err
	}
	s.log.Warn("lease bucket is missing; creating it again with tokens above every token stored and seen", "max_revision_seen", s.maxSeen.Load())
	// The KeyValue handle only names the bucket, so the existing s.kv keeps
	// working against the new stream.
	if _, err = s.openBucket(ctx); err != nil {
		s.repeats.Failed(ctx, s.log, slog.LevelWarn, "could not create the lost lease bucket again; will retry", "err", err)
	}
	return true, err
}

// OpenExisting opens an existing bucket with the TTL it was created with,
// for tools that read leases or seize one (status, replay) and must not
// disagree with the workers about timing. Tokens are the bucket's revisions,
// base included, so such tools need no base of their own. It returns an
// error wrapping jetstream.ErrBucketNotFound when the bucket does not exist
// (no worker created it yet, or it was lost and no worker has created it
// again yet).
func OpenExisting(ctx context.Context, js jetstream.JetStream, bucket string, log *slog.Logger) (*Store, error) {
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return nil, fmt.Errorf("open lease bucket %s: %w", bucket, err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("read lease bucket %s status: %w", bucket, err)
	}
	cfg := StoreConfig{Bucket: bucket, TTL: st.TTL(), SafetyMargin: SafetyMarginFor(st.TTL()), Logger: log}.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("lease bucket %s: %w", bucket, err)
	}
	s := &Store{js: js, kv: kv, cfg: cfg, log: cfg.Logger.With("bucket", bucket), now: time.Now, repeats: repeatlog.New()}
	s.noteBucket(st)
	return s, nil
}
