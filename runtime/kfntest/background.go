package kfntest

import (
	"context"
	"sync"
	"testing"
	"time"
)

// Background runs run(ctx) in a goroutine: a worker's or a relay's Run. The
// returned stop cancels ctx and waits for run to return, failing the test if
// it returned an error or took longer than 30 s. stop is idempotent and also
// runs when the test ends.
func Background(t testing.TB, what string, run func(ctx context.Context) error) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("%s: %v", what, err)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("%s did not stop within 30s of being cancelled", what)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}
