package lease

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

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
}

// OpenStore creates the bucket if it does not exist, or opens it and checks
// that its TTL matches cfg.TTL.
func OpenStore(ctx context.Context, js jetstream.JetStream, cfg StoreConfig) (*Store, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Store{js: js, cfg: cfg, log: cfg.Logger.With("bucket", cfg.Bucket)}
	kv, err := s.openBucket(ctx)
	if err != nil {
		return nil, err
	}
	s.kv = kv
	return s, nil
}

// Config returns the store's configuration, defaults applied.
func (s *Store) Config() StoreConfig { return s.cfg }

// openBucket creates or opens the bucket. It is idempotent, so it is also
// used to recreate a bucket lost with a server's store.
func (s *Store) openBucket(ctx context.Context) (jetstream.KeyValue, error) {
	kvCfg := jetstream.KeyValueConfig{
		Bucket:      s.cfg.Bucket,
		Description: "kfn leases and membership heartbeats (runtime/lease)",
		History:     1,
		TTL:         s.cfg.TTL,
		Storage:     jetstream.FileStorage,
		// Expiry markers let watchers see a key expire; without them only
		// re-listing notices.
		LimitMarkerTTL: s.cfg.TTL,
	}
	kv, err := s.js.CreateKeyValue(ctx, kvCfg)
	if errors.Is(err, jetstream.ErrLimitMarkerTTLNotSupported) {
		s.log.Warn("server does not support KV expiry markers; expiries are noticed by re-listing only")
		kvCfg.LimitMarkerTTL = 0
		kv, err = s.js.CreateKeyValue(ctx, kvCfg)
	}
	if errors.Is(err, jetstream.ErrBucketExists) {
		// Created before with another configuration. Use it if the TTL, on
		// which the safety argument rests, is the same.
		kv, err = s.js.KeyValue(ctx, s.cfg.Bucket)
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
		return kv, nil
	}
	if err != nil {
		return nil, fmt.Errorf("create lease bucket %s: %w", s.cfg.Bucket, err)
	}
	return kv, nil
}

// recreateIfMissing recreates the bucket when the server answers that it
// does not exist, which happens when a server restarted without its store.
// Revisions then start again from 1, so tokens stop growing: Postgres refuses
// the new, smaller tokens and claims stall until an operator resets the
// stored epochs. That is the safe failure, and it is logged as an error.
func (s *Store) recreateIfMissing(ctx context.Context) error {
	_, err := s.js.KeyValue(ctx, s.cfg.Bucket)
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return err
	}
	s.log.Error("lease bucket is missing and is recreated; its revisions restart at 1, so fencing tokens are smaller than before and Postgres will refuse them until stored epochs are reset")
	// The KeyValue handle only names the bucket, so the existing s.kv keeps
	// working against the new stream.
	_, err = s.openBucket(ctx)
	return err
}

// bucketMissing reports whether err may mean that the bucket's stream does
// not exist; recreateIfMissing then asks the server to be sure.
func bucketMissing(err error) bool {
	return errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, jetstream.ErrBucketNotFound) ||
		errors.Is(err, jetstream.ErrNoStreamResponse)
}

// OpenExisting opens an existing bucket with the TTL it was created with,
// for tools that read leases or seize one (status, replay) and must not
// disagree with the workers about timing. It returns an error wrapping
// jetstream.ErrBucketNotFound when no worker ever created the bucket.
func OpenExisting(ctx context.Context, js jetstream.JetStream, bucket string, log *slog.Logger) (*Store, error) {
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return nil, fmt.Errorf("open lease bucket %s: %w", bucket, err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("read lease bucket %s status: %w", bucket, err)
	}
	cfg := StoreConfig{Bucket: bucket, TTL: st.TTL(), SafetyMargin: st.TTL() * 3 / 10, Logger: log}.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("lease bucket %s: %w", bucket, err)
	}
	return &Store{js: js, kv: kv, cfg: cfg, log: cfg.Logger.With("bucket", bucket)}, nil
}
