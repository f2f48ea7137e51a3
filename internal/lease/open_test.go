package lease

import (
	"context"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestOpenStoreWaitsForAJetStreamThatDoesNotAnswerYet opens the store
// while the NATS server is paused (SIGSTOP) for longer than a JetStream
// request's 5 s timeout, as a cluster that has just started answers no
// request about streams until its leaders are elected. A worker started
// with the cluster must wait for it and open the bucket, not exit.
func TestOpenStoreWaitsForAJetStreamThatDoesNotAnswerYet(t *testing.T) {
	server := kfntest.NATSProcess(t)
	js := connect(t, server.URL)
	const paused = 7 * time.Second
	server.Process().Pause()
	resumed := time.AfterFunc(paused, server.Process().Resume)
	defer resumed.Stop()
	defer server.Process().Resume()

	// No deadline, as a worker's: nats.go then gives each JetStream
	// request its default 5 s timeout.
	ctx := context.Background()
	started := time.Now()
	s, err := OpenStore(ctx, js, StoreConfig{Bucket: "test_leases", TTL: testTTL, SafetyMargin: testMargin, Logger: testLogger()})
	if err != nil {
		t.Fatalf("open store %s after the server was paused for %s: %v", time.Since(started).Round(time.Millisecond), paused, err)
	}
	if took := time.Since(started); took < paused {
		t.Fatalf("opened in %s, while the server was paused for %s: the pause did not hold the request", took, paused)
	}
	if _, err := s.kv.Status(ctx); err != nil {
		t.Fatalf("the opened bucket: %v", err)
	}
	t.Logf("opened %s after the start, the server paused for %s", time.Since(started).Round(time.Millisecond), paused)
}
