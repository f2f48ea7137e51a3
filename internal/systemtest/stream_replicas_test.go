package systemtest_test

import (
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// An event stream that exists with other replicas than configured is
// refused, whether a worker would extend it or only check it
// (--nats-provisioned), and left as it is; a provisioned check creates and
// changes nothing and names what is missing.
func TestEventStreamWithOtherReplicasIsRefusedAndProvisionedChangesNothing(t *testing.T) {
	nc, err := nats.Connect(kfntest.NATSURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js := jetStreamOf(t, nc)
	ctx := t.Context()
	stream := kfntest.Name(t, "events")
	limits := outbox.StreamLimits{Duplicates: time.Minute, MaxAge: time.Hour, Replicas: 1}

	if _, err := outbox.ProvisionedStream(ctx, js, stream, []string{stream + ".a"}, 1); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("provisioned check of a missing stream: %v; want stream not found", err)
	}
	if _, err := js.Stream(ctx, stream); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("the provisioned check created the stream: %v", err)
	}
	if _, err := outbox.ExtendStream(ctx, js, stream, []string{stream + ".a"}, limits); err != nil {
		t.Fatal(err)
	}
	var re *lease.ReplicasError
	limits.Replicas = 3
	if _, err := outbox.ExtendStream(ctx, js, stream, []string{stream + ".b"}, limits); !errors.As(err, &re) || re.Have != 1 || re.Want != 3 {
		t.Fatalf("extend a stream of 1 replica configured with 3: %v; want a *lease.ReplicasError", err)
	}
	if _, err := outbox.ProvisionedStream(ctx, js, stream, []string{stream + ".a"}, 3); !errors.As(err, &re) {
		t.Fatalf("provisioned check of a stream of 1 replica configured with 3: %v; want a *lease.ReplicasError", err)
	}
	var mismatch *outbox.StreamMismatchError
	if _, err := outbox.ProvisionedStream(ctx, js, stream, []string{stream + ".b"}, 1); !errors.As(err, &mismatch) || mismatch.Uncovered != stream+".b" {
		t.Fatalf("provisioned check of an uncovered subject: %v; want a StreamMismatchError for it", err)
	}
	got, err := outbox.ProvisionedStream(ctx, js, stream, []string{stream + ".a"}, 1)
	if err != nil || len(got) != 1 || got[0] != stream+".a" {
		t.Fatalf("provisioned check of a covered subject = %v, %v", got, err)
	}
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	if cfg := s.CachedInfo().Config; cfg.Replicas != 1 || len(cfg.Subjects) != 1 {
		t.Fatalf("the stream changed: %d replicas, subjects %v", cfg.Replicas, cfg.Subjects)
	}
}
