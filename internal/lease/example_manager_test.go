package lease_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/devstack"
	"github.com/kfn-dev/kfn/internal/lease"
)

// A worker runs a Manager over the partitions of its topic. Each claim comes
// with a fencing token that the worker records in Postgres and checks on
// every commit.
func ExampleManager() {
	srv, err := devstack.StartNATS("")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer srv.Stop()
	// Reconnect forever: the manager rides out NATS outages.
	nc, err := nats.Connect(srv.URL, nats.MaxReconnects(-1))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		fmt.Println(err)
		return
	}

	m, err := lease.NewManager(context.Background(), js, lease.Config{
		Group:    "orders-fn/orders",
		MemberID: "worker-1",
		Logger:   slog.New(slog.DiscardHandler),
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	partitions := func(context.Context) ([]string, error) {
		return []string{"orders/0", "orders/1", "orders/2"}, nil // from Kafka metadata
	}
	var mu sync.Mutex
	var claimed []string
	allClaimed := make(chan struct{})
	work := func(ctx context.Context, c lease.Claim) {
		// A real worker claims c.Item in Postgres with c.Token, then reads and
		// commits batches, each checking the token, until ctx is cancelled.
		mu.Lock()
		claimed = append(claimed, c.Item)
		if len(claimed) == 3 {
			close(allClaimed)
		}
		mu.Unlock()
		<-ctx.Done()
		// Finish the in-flight batch here; the lease is released on return.
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx, partitions, work) }()
	<-allClaimed
	cancel()
	if err := <-done; err != nil {
		fmt.Println(err)
	}

	slices.Sort(claimed)
	for _, p := range claimed {
		fmt.Println("worker-1 held", p)
	}
	// Output:
	// worker-1 held orders/0
	// worker-1 held orders/1
	// worker-1 held orders/2
}
