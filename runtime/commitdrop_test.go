package runtime_test

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestCommitWhoseReplyIsLostIsNeitherRepeatedNorMistakenForATakeover makes
// commits land while the worker sees them fail. Retrying would apply the
// batch twice without the fence; with it, the worker must see that the
// cursor moved under its own token, resume from there, and keep its
// partitions.
func TestCommitWhoseReplyIsLostIsNeitherRepeatedNorMistakenForATakeover(t *testing.T) {
	b := setup(t, 1)
	u, err := url.Parse(b.pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := kfntest.PostgresProxy(t, u.Host)
	u.Host = proxy.Addr()
	b.cfg.DatabaseURL = u.String()
	b.cfg.NoRelay = true // only the record path talks to Postgres through the proxy

	fn := effects.Function(b.fn, b.topic)
	w, stop := b.run(t, fn)
	// Arm the proxy only once the claim has committed, so that it cuts
	// batch commits: a cut claim would test something else.
	waitFor(t, 30*time.Second, "the partition's claim", func() bool {
		var n int
		err := b.pg.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kfn.cursors WHERE consumer = $1`, b.fn).Scan(&n)
		return err == nil && n == 1
	})
	var produced []effects.Produced
	for round := 0; round < 3; round++ {
		proxy.CutCommits(1)
		produced = append(produced, b.produceN(t, 1, 10)...)
		b.waitCaughtUp(t, b.fn)
		// The cursor is visible as soon as the server has committed; the
		// proxy counts the cut when it reads the COMMIT's reply, a moment
		// later (a check at once missed it under -race).
		waitFor(t, 10*time.Second, "the proxy to cut the round's commit", func() bool {
			return proxy.CommitsCut() >= round+1
		})
		if n := proxy.CommitsCut(); n != round+1 {
			t.Fatalf("round %d: the proxy cut off %d commits in all, want %d", round, n, round+1)
		}
		// The cut commit landed, so the cursor is caught up; the lane's
		// retry must still find the cursor ahead under its own token.
		waitFor(t, 30*time.Second, "the lane to recover from the lost commit reply", func() bool {
			return w.Stats().CommitRepliesLost.Load() >= int64(round+1)
		})
	}
	stop()
	if rep := b.check(t, b.fn, produced); rep.Applied != 30 {
		t.Errorf("applied %d, want 30", rep.Applied)
	}
	// Each cut commit landed: the lane's next transaction must have found
	// the cursor ahead under its own token and resumed from it.
	if got, want := w.Stats().CommitRepliesLost.Load(), int64(proxy.CommitsCut()); got != want {
		t.Errorf("the lane recovered from %d commits whose reply was lost, want %d (one per cut commit)", got, want)
	}
	if n := w.Stats().Fenced.Load(); n != 0 {
		t.Errorf("the worker dropped its partition %d times as fenced after its own commit landed", n)
	}
}
