package runtime_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// A worker reaches a NATS server that wants TLS and a user of its operator
// (decentralized JWT auth) with --nats-creds and --nats-ca, and processes
// records end to end: every record applied once, every event in the
// stream. Without the credentials, or trusting another CA, it is refused
// at start, fast, with a message naming the flag to set and holding
// neither the user's JWT nor its seed.
func TestWorkerWithNATSCredsAndTLSProcessesAndIsRefusedWithout(t *testing.T) {
	const partitions, perPartition = 2, 50
	sn := kfntest.StartSecureNATS(t)
	creds, userJWT, seed := sn.User("worker")
	b := setup(t, partitions)
	b.cfg.NATSURL = sn.URL
	b.cfg.EventStream = kfntest.Name(t, "EVENTS")
	fn := effects.Function(b.fn, b.topic)

	refused := func(name string, sec runtime.NATSSecurity, want string) {
		t.Helper()
		cfg := b.cfg
		cfg.NATSSecurity = sec
		start := time.Now()
		w, err := worker.New(context.Background(), cfg, fn)
		took := time.Since(start)
		if err == nil {
			w.Close()
			t.Fatalf("%s: the worker started", name)
		}
		t.Logf("%s: refused in %s: %v", name, took.Round(time.Millisecond), err)
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %q does not name %s", name, err, want)
		}
		for what, secret := range map[string]string{"seed": seed, "JWT": userJWT} {
			if strings.Contains(err.Error(), secret) {
				t.Errorf("%s: the error holds the user's %s", name, what)
			}
		}
		if took > 5*time.Second {
			t.Errorf("%s: refused after %s; want a fast refusal", name, took)
		}
	}
	refused("no credentials", runtime.NATSSecurity{CAFile: sn.CAFile}, "--nats-creds (KFN_NATS_CREDS)")
	refused("untrusted CA", runtime.NATSSecurity{Creds: creds, CAFile: sn.OtherCA()}, "--nats-ca (KFN_NATS_CA)")
	refused("no CA", runtime.NATSSecurity{Creds: creds}, "--nats-ca (KFN_NATS_CA)")

	b.cfg.NATSSecurity = runtime.NATSSecurity{Creds: creds, CAFile: sn.CAFile}
	produced := b.produceN(t, partitions, perPartition)
	_, stop := b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	nc, js, err := connect.NATSWith(sn.URL, "checker", runtime.NATSSecurity(b.cfg.NATSSecurity))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	waitFor(t, 30*time.Second, "every event in the stream", func() bool {
		s, err := js.Stream(context.Background(), b.cfg.EventStream)
		return err == nil && s.CachedInfo().State.Msgs >= uint64(len(produced))
	})
	stop()
	rep, err := effects.Check(context.Background(), b.pg.Pool, b.fn, b.topic, produced, effects.Events(js, b.cfg.EventStream))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("checker: %s", rep)
	if v := rep.Violations(); len(v) > 0 || rep.Expected != len(produced) {
		t.Errorf("exactly-once violated (of %d records): %s", rep.Expected, strings.Join(v, "; "))
	}
	var inbox int
	if err := b.pg.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = $1`, b.fn).Scan(&inbox); err != nil {
		t.Fatal(err)
	}
	if inbox != len(produced) {
		t.Errorf("inbox rows = %d, want %d", inbox, len(produced))
	}
}
