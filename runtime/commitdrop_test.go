package runtime_test

import (
	"net/url"
	"testing"

	"github.com/kfn-dev/kfn/runtime/internal/effects"
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
	proxy := newPGProxy(t, u.Host)
	u.Host = proxy.Addr()
	b.cfg.DatabaseURL = u.String()
	b.cfg.NoRelay = true // only the record path talks to Postgres through the proxy

	fn := effects.Function(b.fn, b.topic)
	w, stop := b.run(t, fn)
	var produced []effects.Produced
	for round := 0; round < 3; round++ {
		proxy.CutCommits(1)
		produced = append(produced, b.produceN(t, 1, 10)...)
		b.waitCaughtUp(t, b.fn)
	}
	stop()
	if proxy.dropped.Load() < 3 {
		t.Fatalf("the proxy cut off %d commits, want 3: the scenario did not happen", proxy.dropped.Load())
	}
	if rep := b.check(t, b.fn, produced); rep.Applied != 30 {
		t.Errorf("applied %d, want 30", rep.Applied)
	}
	if n := w.Stats().Fenced.Load(); n != 0 {
		t.Errorf("the worker dropped its partition %d times as fenced after its own commit landed", n)
	}
}
