package outbox

import (
	"context"
	"os"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// producer commits rows for keys in small transactions, one after another,
// so each key's commit order is its insert order.
type producer struct {
	f         *relayFixture
	mu        sync.Mutex
	committed []Row
	stop      chan struct{}
	done      chan struct{}
}

func startProducer(f *relayFixture, keys []string, rounds int, pause time.Duration) *producer {
	p := &producer{f: f, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		for i := 0; i < rounds; i++ {
			select {
			case <-p.stop:
				return
			case <-time.After(pause):
			}
			rows := f.newRows(keys, 1)
			if err := f.tryInsert(rows); err != nil {
				f.t.Errorf("producer: %v", err)
				return
			}
			p.mu.Lock()
			p.committed = append(p.committed, rows...)
			p.mu.Unlock()
		}
	}()
	return p
}

// wait waits for the producer to finish and returns what it committed.
func (p *producer) wait() []Row {
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Row{}, p.committed...)
}

func (p *producer) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.committed)
}

// Two relays work every shard at once (as during a lease handover, or with
// no leases at all) while rows keep coming and NATS is stopped and started
// again: every event lands once, in key order.
func TestRelayTwoRelaysSurviveNATSRestartUnderLoad(t *testing.T) {
	t.Parallel()
	nats := kfntest.NATSProcess(t)
	f := newRelayFixture(t, nats.URL)
	cfgA := f.config()
	cfgA.AckTimeout = time.Second
	cfgB := cfgA
	_, cfgB.JetStream = connectJetStream(t, nats.URL)
	relayA, _ := f.startRelay(cfgA)
	relayB, _ := f.startRelay(cfgB)

	p := startProducer(f, keyNames("k", 100), 120, 25*time.Millisecond)
	waitUntil(t, 20*time.Second, "the first events are relayed", func() bool {
		return relayA.Stats().Published+relayB.Stats().Published > 500
	})
	nats.Stop()
	stoppedAt := p.count()
	time.Sleep(1500 * time.Millisecond)
	if err := nats.Start(); err != nil {
		t.Fatal(err)
	}
	if p.count() == stoppedAt {
		t.Fatal("the producer stalled during the NATS outage; the test needs rows committed meanwhile")
	}

	all := p.wait()
	f.waitDelivered(len(all), 60*time.Second)
	f.requireExactlyOnceInOrder(all)
	a, b := relayA.Stats(), relayB.Stats()
	if a.Failures+b.Failures == 0 {
		t.Fatalf("no publish failed (stats %+v, %+v): the restart did not hit the relays", a, b)
	}
	t.Logf("relay A %+v; relay B %+v", a, b)
}

// heldShards matches the lease manager's summary line (text handler) of a
// relay process holding at least one shard.
var heldShards = regexp.MustCompile(`msg="leases held" .*held=[1-9]`)

// Three relay processes split the shards with leases; NATS (which also holds
// the leases) restarts under load.
func TestRelayLeasedProcessesSurviveNATSRestart(t *testing.T) {
	t.Parallel()
	nats := kfntest.NATSProcess(t)
	f := newRelayFixture(t, nats.URL)
	group := "GROUP=" + kfntest.Name(t, "relay")
	var procs []*relayProc
	for _, member := range []string{"m1", "m2", "m3"} {
		procs = append(procs, f.startRelayProc(nats.URL, "KFN_LEASE_"+group, "KFN_MEMBER="+member))
	}

	p := startProducer(f, keyNames("k", 100), 120, 25*time.Millisecond)
	waitUntil(t, 20*time.Second, "the first events are relayed", func() bool { return f.streamMsgs() > 500 })
	nats.Stop()
	time.Sleep(1500 * time.Millisecond)
	if err := nats.Start(); err != nil {
		t.Fatal(err)
	}
	all := p.wait()
	f.waitDelivered(len(all), 60*time.Second)
	for _, proc := range procs {
		proc.stop()
	}
	f.requireExactlyOnceInOrder(all)
	for i, proc := range procs {
		log, err := os.ReadFile(proc.LogFile)
		if err != nil {
			t.Fatal(err)
		}
		if !heldShards.Match(log) {
			t.Errorf("relay process m%d never held a shard: the shards were not split", i+1)
		}
	}
}

func waitUntil(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting until %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// The relay's Postgres connections (pool and LISTEN) are killed again and
// again under load: it retries, and every event still lands once, in order.
func TestRelaySurvivesPostgresConnectionLoss(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	appName := kfntest.Name(t, "relay")
	pcfg, err := pgxpool.ParseConfig(f.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = appName
	pcfg.MaxConns = 8
	relayPool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer relayPool.Close()
	cfg := f.config()
	cfg.Pool = relayPool
	relay, stop := f.startRelay(cfg)
	defer stop()

	p := startProducer(f, keyNames("k", 50), 100, 20*time.Millisecond)
	killed := 0
	for range 15 {
		time.Sleep(100 * time.Millisecond)
		var n int
		err := f.db.Pool.QueryRow(context.Background(),
			`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1 AND datname = current_database()`,
			appName).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		killed += n
	}
	all := p.wait()
	f.waitDelivered(len(all), 60*time.Second)
	f.requireExactlyOnceInOrder(all)
	if killed < 15 {
		t.Fatalf("killed only %d relay connections; the test meant to kill more", killed)
	}
	if !relay.Stats().Listening {
		waitUntil(t, 10*time.Second, "the relay listens again", func() bool { return relay.Stats().Listening })
	}
}
