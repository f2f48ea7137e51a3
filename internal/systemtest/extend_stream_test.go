package systemtest_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestFunctionsStartingTogetherAllGetTheirSubjectsIntoTheStream is what
// happens when several functions (orders, ledger, …) roll out at once: each
// worker calls outbox.ExtendStream for its Emits on the shared event stream.
// Every subject must end up captured; a lost one leaves that function's
// events parked in the outbox.
func TestFunctionsStartingTogetherAllGetTheirSubjectsIntoTheStream(t *testing.T) {
	const functions, rounds = 4, 10
	nc, err := nats.Connect(kfntest.NATSURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js := jetStreamOf(t, nc)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for round := range rounds {
		stream := kfntest.Name(t, "events")
		// The stream exists already, made by a function deployed earlier.
		if _, err := outbox.ExtendStream(ctx, js, stream, []string{stream + ".earlier"}, outbox.StreamLimits{Duplicates: time.Minute, MaxAge: time.Hour}); err != nil {
			t.Fatal(err)
		}
		want := []string{stream + ".earlier"}
		var wg sync.WaitGroup
		for i := range functions {
			subject := fmt.Sprintf("%s.fn%d.>", stream, i)
			want = append(want, subject)
			wg.Go(func() {
				if _, err := outbox.ExtendStream(ctx, js, stream, []string{subject}, outbox.StreamLimits{Duplicates: time.Minute, MaxAge: time.Hour}); err != nil {
					t.Errorf("extend %s with %s: %v", stream, subject, err)
				}
			})
		}
		wg.Wait()
		s, err := js.Stream(ctx, stream)
		if err != nil {
			t.Fatal(err)
		}
		got := s.CachedInfo().Config.Subjects
		for _, w := range want {
			if !slices.Contains(got, w) {
				t.Fatalf("round %d: %d functions extended the stream at once and it captures %v: %s is lost", round, functions, got, w)
			}
		}
		if err := js.DeleteStream(ctx, stream); err != nil {
			t.Fatal(err)
		}
	}
}
