package lease

import (
	"context"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/devstack"
)

// Test timing: short, but with the same proportions as the defaults.
const (
	testTTL    = 2 * time.Second
	testRenew  = 300 * time.Millisecond
	testMargin = 600 * time.Millisecond
)

// Timing assertions in these tests come in two kinds. Safety bounds are
// strict: a holder stops working before its lease can expire on the server
// (less than TTL after the send time of its last successful write), and
// nobody takes a lease before it expired (TTL after that send time or
// later). Load on the machine can only make a holder stop later, so a
// safety bound that fails is a real bug, or load beyond what the safety
// margin is for. Promptness (how soon after its validity a holder stops,
// how soon after expiry another takes over) is reported with t.Logf; the
// only assertions on it are liveness bounds several TTLs wide
// (livenessBound), which catch a claim that hangs, not a slow machine.
const livenessBound = 10 * time.Second

// renewals records the send time of each item's last successful renewal
// by one manager, through its onRenewed hook.
type renewals struct {
	mu   sync.Mutex
	sent map[string]time.Time
}

func watchRenewals(m *Manager) *renewals {
	r := &renewals{sent: map[string]time.Time{}}
	m.onRenewed = func(item string, sent time.Time) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.sent[item] = sent
	}
	return r
}

// last returns the send time of item's last successful renewal, and
// whether there was one.
func (r *renewals) last(item string) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	t, ok := r.sent[item]
	return t, ok
}

type testBundle struct {
	nats  *devstack.NATS
	js    jetstream.JetStream
	store *Store
}

// setup starts an embedded NATS server and opens a store with test timing.
func setup(t *testing.T) testBundle {
	t.Helper()
	n, err := devstack.StartNATS("")
	if err != nil {
		t.Fatalf("start NATS: %v", err)
	}
	t.Cleanup(n.Stop)
	js := connect(t, n.URL)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	store, err := OpenStore(ctx, js, StoreConfig{Bucket: "test_leases", TTL: testTTL, SafetyMargin: testMargin, Logger: testLogger()})
	if err != nil {
		t.Fatalf("open store: %v", err)
	}
	return testBundle{nats: n, js: js, store: store}
}

// connect opens a connection that reconnects forever, as workers should.
func connect(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatalf("connect NATS: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("jetstream: %v", err)
	}
	return js
}

// testLogger is quiet unless KFN_TEST_LOG is set.
func testLogger() *slog.Logger {
	if os.Getenv("KFN_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// waitFor polls cond every 10 ms until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > d {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return time.Since(start)
}
