package lease

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// tracker records which member runs work on which item, and flags two
// members working on one item at once or a token that does not grow.
type tracker struct {
	mu      sync.Mutex
	running map[string]string // item → member
	token   map[string]uint64 // item → latest token
	started map[string]time.Time
	ended   map[string]time.Time // item → when the last work on it returned
	causes  map[string]error     // item → cause of the last cancellation
	errs    []string
}

func newTracker() *tracker {
	return &tracker{running: map[string]string{}, token: map[string]uint64{}, started: map[string]time.Time{},
		ended: map[string]time.Time{}, causes: map[string]error{}}
}

func (tr *tracker) work(member string) func(context.Context, Claim) {
	return func(ctx context.Context, c Claim) {
		tr.mu.Lock()
		if other, ok := tr.running[c.Item]; ok {
			tr.errs = append(tr.errs, fmt.Sprintf("%s started %s (token %d) while %s still works on it", member, c.Item, c.Token, other))
		}
		if c.Token <= tr.token[c.Item] {
			tr.errs = append(tr.errs, fmt.Sprintf("%s got token %d for %s after token %d", member, c.Token, c.Item, tr.token[c.Item]))
		}
		tr.running[c.Item] = member
		tr.token[c.Item] = c.Token
		tr.started[c.Item] = time.Now()
		tr.mu.Unlock()

		<-ctx.Done()

		tr.mu.Lock()
		if tr.running[c.Item] == member {
			delete(tr.running, c.Item)
		}
		tr.ended[c.Item] = time.Now()
		tr.causes[c.Item] = context.Cause(ctx)
		tr.mu.Unlock()
	}
}

func (tr *tracker) owners() map[string]string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return maps.Clone(tr.running)
}

// ownsAll reports whether member runs work on all n items, and nobody else
// on any.
func (tr *tracker) ownsAll(member string, n int) bool {
	owners := tr.owners()
	return len(owners) == n && !slices.ContainsFunc(slices.Collect(maps.Values(owners)), func(o string) bool { return o != member })
}

// itemsOf is an items function listing n items.
func itemsOf(n int) *itemList {
	l := &itemList{}
	l.set(names("orders/", n))
	return l
}

func (tr *tracker) tokens() map[string]uint64 {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return maps.Clone(tr.token)
}

func (tr *tracker) check(t *testing.T) {
	t.Helper()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for _, e := range tr.errs {
		t.Error(e)
	}
}

// itemList is a mutable items function.
type itemList struct {
	mu    sync.Mutex
	items []string
}

func (l *itemList) set(items []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.items = items
}

func (l *itemList) get(context.Context) ([]string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.items, nil
}

func testManagerConfig(member string) Config {
	return Config{
		Bucket: "test_leases", Group: "fn.orders", MemberID: member,
		TTL: testTTL, RenewEvery: testRenew, SafetyMargin: testMargin,
		PollItemsEvery: 500 * time.Millisecond, Logger: testLogger().With("test_member", member),
	}
}

// runMember starts m.Run and returns a function that stops it and checks it
// returned nil.
func runMember(t *testing.T, m *Manager, items *itemList, tr *tracker) (stop func()) {
	t.Helper()
	return kfntest.Background(t, "Run of "+m.Config().MemberID, func(ctx context.Context) error {
		return m.Run(ctx, items.get, tr.work(m.Config().MemberID))
	})
}

func newManager(t *testing.T, js jetstream.JetStream, cfg Config) *Manager {
	t.Helper()
	m, err := NewManager(context.Background(), js, cfg)
	if err != nil {
		t.Fatalf("new manager %s: %v", cfg.MemberID, err)
	}
	return m
}
