package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/lease"
)

// StreamMismatchError means the configured stream exists but does not
// capture every configured subject. The relay does not change a stream it
// did not create.
type StreamMismatchError struct {
	Stream    string
	Has       []string // the stream's subjects
	Uncovered string   // a configured subject none of them covers
}

func (e *StreamMismatchError) Error() string {
	return fmt.Sprintf("stream %s exists with subjects %v, which do not cover %q: add %q to the stream's subjects or configure another stream name",
		e.Stream, e.Has, e.Uncovered, e.Uncovered)
}

// ensureStream creates the relay's stream if it is missing and returns the
// subjects it captures. An existing stream is left as it is, provided its
// subjects cover the configured ones.
func (r *Relay) ensureStream(ctx context.Context) ([]string, error) {
	for attempt := 0; ; attempt++ {
		stream, err := r.cfg.JetStream.Stream(ctx, r.cfg.Stream)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			_, err = r.cfg.JetStream.CreateStream(ctx, streamConfig(r.cfg.Stream, r.cfg.Subjects, StreamLimits{Duplicates: r.cfg.Duplicates, MaxAge: r.cfg.MaxAge, Replicas: r.cfg.Replicas}))
			if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) && attempt == 0 {
				continue // another relay created it just now: check its subjects
			}
			if err != nil {
				return nil, fmt.Errorf("create stream %s: %w", r.cfg.Stream, err)
			}
			r.log.Info("created outbox stream", "stream", r.cfg.Stream, "subjects", r.cfg.Subjects, "duplicates", r.cfg.Duplicates, "max_age", r.cfg.MaxAge)
			return r.cfg.Subjects, nil
		}
		if err != nil {
			return nil, fmt.Errorf("look up stream %s: %w", r.cfg.Stream, err)
		}
		have := stream.CachedInfo().Config
		for _, want := range r.cfg.Subjects {
			if !CoversSubject(have.Subjects, want) {
				return nil, &StreamMismatchError{Stream: r.cfg.Stream, Has: have.Subjects, Uncovered: want}
			}
		}
		if have.Duplicates < r.cfg.Duplicates {
			r.log.Warn("outbox stream's duplicate window is shorter than configured; events republished after it are deduplicated only by the downstream inbox",
				"stream", r.cfg.Stream, "duplicates", have.Duplicates, "configured", r.cfg.Duplicates)
		}
		return have.Subjects, nil
	}
}

// StreamLimits are the settings a stream is created with.
type StreamLimits struct {
	// Duplicates is the window in which JetStream drops a republished
	// Nats-Msg-Id; the downstream inbox drops repeats after it.
	Duplicates time.Duration
	// MaxAge bounds the stream: events older than this are removed, so it
	// does not grow without bound. Consumers must keep up within it.
	MaxAge time.Duration
	// Replicas is the number of replicas of the stream (0: the server's
	// default, 1). An existing stream with another number is refused with
	// a *lease.ReplicasError, never changed.
	Replicas int
}

// Defaults of the event stream.
const (
	DefaultStream       = "KFN_EVENTS"
	DefaultDuplicates   = 2 * time.Minute
	DefaultStreamMaxAge = 7 * 24 * time.Hour
)

// streamConfig is how kfn creates an event stream, whoever creates it.
func streamConfig(name string, subjects []string, limits StreamLimits) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name: name, Description: "kfn outbox events", Subjects: subjects,
		Duplicates: limits.Duplicates, MaxAge: limits.MaxAge, Storage: jetstream.FileStorage, Replicas: limits.Replicas,
	}
}

// ExtendStream makes sure stream exists and captures subjects: it creates
// the stream (file storage, with limits) or adds the subjects an existing
// stream lacks, and returns all the subjects it captures. Each function
// binary calls it for the subjects it emits, so a stream shared by many
// functions grows to cover all of them; subjects are never removed.
func ExtendStream(ctx context.Context, js jetstream.JetStream, name string, subjects []string, limits StreamLimits) ([]string, error) {
	// A stream update replaces the whole subject list, so two processes
	// adding different subjects at once would drop one of them: take turns.
	unlock, err := lockStream(ctx, js, name, limits.Replicas)
	if err != nil {
		return nil, err
	}
	defer unlock()
	stream, err := js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		_, err = js.CreateStream(ctx, streamConfig(name, subjects, limits))
		if err == nil {
			return subjects, nil
		}
		if !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return nil, fmt.Errorf("create stream %s: %w", name, err)
		}
		stream, err = streamJustCreated(ctx, js, name) // by another process
	}
	if err != nil {
		return nil, fmt.Errorf("look up stream %s: %w", name, err)
	}
	cfg := stream.CachedInfo().Config
	if limits.Replicas > 0 && cfg.Replicas != limits.Replicas {
		return nil, &lease.ReplicasError{Stream: name, Have: cfg.Replicas, Want: limits.Replicas}
	}
	var missing []string
	for _, s := range subjects {
		if !CoversSubject(cfg.Subjects, s) {
			missing = append(missing, s)
		}
	}
	if len(missing) == 0 {
		return cfg.Subjects, nil
	}
	cfg.Subjects = append(cfg.Subjects, missing...)
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		return nil, fmt.Errorf("add subjects %v to stream %s: %w", missing, name, err)
	}
	return cfg.Subjects, nil
}

// streamJustCreated looks up a stream that another process created a
// moment ago. On a NATS cluster the server that answers may not know it
// yet, so "not found" is asked again for up to 5 s.
func streamJustCreated(ctx context.Context, js jetstream.JetStream, name string) (jetstream.Stream, error) {
	deadline := time.Now().Add(5 * time.Second)
	for {
		stream, err := js.Stream(ctx, name)
		if !errors.Is(err, jetstream.ErrStreamNotFound) || time.Now().After(deadline) {
			return stream, err
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// streamLocksBucket holds one short-lived key per stream being extended.
const streamLocksBucket = "kfn_stream_locks"

// lockStream takes the stream's extension lock, waiting for another
// holder to release it (or for its key to expire, if it died holding it).
// The bucket is created with replicas if it is missing; an existing one is
// used as it is.
func lockStream(ctx context.Context, js jetstream.JetStream, name string, replicas int) (func(), error) {
	kv, err := js.KeyValue(ctx, streamLocksBucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket: streamLocksBucket, Description: "kfn: serialises updates of event stream subjects",
			History: 1, TTL: 30 * time.Second, Storage: jetstream.FileStorage, Replicas: replicas,
		})
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = js.KeyValue(ctx, streamLocksBucket) // created by another process just now
		}
	}
	if err != nil {
		return nil, fmt.Errorf("stream lock bucket %s: %w", streamLocksBucket, err)
	}
	for {
		rev, err := kv.Create(ctx, name, nil)
		if err == nil {
			return func() {
				ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
				defer cancel()
				kv.Delete(ctx, name, jetstream.LastRevision(rev)) //nolint:errcheck // it expires anyway
			}, nil
		}
		if !lease.CreateConflict(err) {
			return nil, fmt.Errorf("lock stream %s for an update: %w", name, err)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("lock stream %s for an update: %w", name, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// ProvisionedStream returns the subjects of stream name, which someone else
// created (kfn: `kfn migrate --nats`), after checking that they cover
// subjects and that it has replicas (unless 0); it changes nothing. The
// error wraps jetstream.ErrStreamNotFound when the stream does not exist,
// and is a *StreamMismatchError when a subject is not captured.
func ProvisionedStream(ctx context.Context, js jetstream.JetStream, name string, subjects []string, replicas int) ([]string, error) {
	stream, err := js.Stream(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("look up stream %s: %w", name, err)
	}
	cfg := stream.CachedInfo().Config
	if replicas > 0 && cfg.Replicas != replicas {
		return nil, &lease.ReplicasError{Stream: name, Have: cfg.Replicas, Want: replicas}
	}
	for _, want := range subjects {
		if !CoversSubject(cfg.Subjects, want) {
			return nil, &StreamMismatchError{Stream: name, Has: cfg.Subjects, Uncovered: want}
		}
	}
	return cfg.Subjects, nil
}
