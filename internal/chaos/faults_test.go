//go:build chaos

package chaos_test

import (
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// fault is one row of the matrix. inject hurts the running deployment,
// heals it, and returns what it hit.
type fault struct {
	name string
	// skipped says why the fault cannot run here ("" when it can).
	skipped func(r *run) string
	inject  func(r *run, n int) hit
}

// hit is what a fault stopped: lanes, from at. at is the fault itself when
// a healthy worker could take over at once, or the heal when nothing can
// move before it (a whole service down). When the fault hit workers (from),
// a lane flows again when another worker moves it.
type hit struct {
	at    time.Time
	lanes []lane
	from  []string
}

// everything is a hit on every lane from now.
func (r *run) everything() hit { return hit{at: time.Now(), lanes: r.prog.owned(nil)} }

// faults is the matrix, in the order a run plays it.
var faults = []fault{
	{name: "worker SIGKILL", inject: killWorker},
	{name: "worker SIGSTOP > TTL, SIGCONT", inject: pauseWorker},
	{name: "workers added and removed", inject: scaleWorkers},
	{name: "Kafka broker killed (partition leader)", inject: killBroker, skipped: brokerKillSkipped},
	{name: "NATS node killed (lease bucket leader)", inject: killNATSNode},
	{name: "NATS cluster restarted", inject: restartNATS},
	{name: "Postgres restarted", inject: restartPostgres},
	{name: "worker↔Postgres path frozen", inject: freezePath},
	{name: "relay SIGKILL", inject: killRelay},
	{name: "replay while running", inject: replay},
	{name: "poison record", inject: poison},
}

// selectFaults is the matrix, or its faults whose names match only.
func selectFaults(only string) ([]fault, error) {
	if only == "" {
		return faults, nil
	}
	re, err := regexp.Compile(only)
	if err != nil {
		return nil, fmt.Errorf("--only %q: %w", only, err)
	}
	var sel []fault
	for _, f := range faults {
		if re.MatchString(f.name) {
			sel = append(sel, f)
		}
	}
	if len(sel) == 0 {
		return nil, fmt.Errorf("--only %q matches no fault", only)
	}
	return sel, nil
}

// stage is the function a worker fault hits: orders and ledger in turn.
func stage(n int) string {
	if n%2 == 0 {
		return ordersFn
	}
	return ledger.Name
}

func killWorker(r *run, n int) hit {
	fn := stage(n)
	v := r.victim(fn, n/2)
	lanes := r.prog.owned([]string{v.id})
	v.Kill()
	at := time.Now()
	r.s.forget(v)
	r.logf("SIGKILL %s, which held %s", v.id, laneList(lanes))
	r.s.startWorker(fn)
	return hit{at, lanes, []string{v.id}}
}

func pauseWorker(r *run, n int) hit {
	v := r.victim(stage(n), n/2)
	lanes := r.prog.owned([]string{v.id})
	v.Pause()
	at := time.Now()
	r.logf("SIGSTOP %s, which held %s, for %s", v.id, laneList(lanes), 2*leaseTTL)
	time.Sleep(2 * leaseTTL)
	v.Resume()
	r.logf("SIGCONT %s: a zombie, fenced by the epoch", v.id)
	return hit{at, lanes, []string{v.id}}
}

// scaleWorkers adds a worker to each function, waits until they run, and
// removes an older one of each with SIGTERM: a clean handoff each way.
func scaleWorkers(r *run, n int) hit {
	added := []*proc{r.s.startWorker(ordersFn), r.s.startWorker(ledger.Name)}
	for _, w := range added {
		r.s.waitStarted(w)
	}
	time.Sleep(leaseTTL) // the new workers take their share
	removed := []*proc{r.victim(ordersFn, n), r.victim(ledger.Name, n)}
	lanes := r.prog.owned([]string{removed[0].id, removed[1].id})
	at := time.Now()
	var wg sync.WaitGroup
	for _, w := range removed {
		wg.Go(w.Stop)
	}
	wg.Wait()
	for _, w := range removed {
		r.s.forget(w)
		if err := w.ExitErr(); err != nil {
			r.t.Errorf("%s exited with %v on SIGTERM; output:\n%s", w.id, err, w.LogTail(40))
		}
	}
	r.logf("added %s and %s, removed %s and %s, which held %s", added[0].id, added[1].id, removed[0].id, removed[1].id, laneList(lanes))
	return hit{at, lanes, []string{removed[0].id, removed[1].id}}
}

func brokerKillSkipped(r *run) string {
	if r.s.kafka.canKillBrokers() {
		return ""
	}
	return r.s.kafka.noKill
}

// killBroker SIGKILLs the broker leading a partition of orders (each
// injection the next partition) and starts it again after 3 lease TTLs:
// the partition's leadership moves to an in-sync replica, and the workers'
// readers and the producer follow it.
func killBroker(r *run, n int) hit {
	p := n % partitions
	h := r.everything()
	id, at := r.s.kafka.killLeader(r.t, r.s.topic, p, 3*leaseTTL)
	// The partition cannot be read before Kafka fences the dead leader
	// (kafka.sh's cluster: a broker session of 4 s) and elects another: the
	// lanes' takeover counts from then, as from a whole service's heal.
	h.at = at.Add(kafkaBrokerSession)
	r.logf("SIGKILLed Kafka broker %d, the leader of partition %d, and started it again after %s", id, p, 3*leaseTTL)
	return h
}

// kafkaBrokerSession is how long the cluster of deploy/local/kafka takes to
// fence a broker that stopped answering (broker.session.timeout.ms).
const kafkaBrokerSession = 4 * time.Second

// natsLeader is the NATS server leading stream's raft group; it waits up
// to limit for the group to have a leader.
func (r *run) natsLeader(stream string, limit time.Duration) *kfntest.NATSServer {
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	var leader string
	var seen []string // what each failed look-up said, in order, repeats once
	for leader == "" {
		// One look-up can go unanswered (a request that reached a
		// restarted server before its JetStream was back), so each gets
		// a short deadline of its own.
		lookCtx, lookCancel := context.WithTimeout(ctx, 2*time.Second)
		st, err := r.js.Stream(lookCtx, stream)
		lookCancel()
		if err == nil && st.CachedInfo().Cluster != nil {
			leader = st.CachedInfo().Cluster.Leader
		}
		if leader == "" {
			what := fmt.Sprintf("%s no leader", time.Now().Format("15:04:05.000"))
			if err != nil {
				what = fmt.Sprintf("%s %v", time.Now().Format("15:04:05.000"), err)
			}
			if len(seen) == 0 || seen[len(seen)-1][13:] != what[13:] {
				seen = append(seen, what)
			}
			select {
			case <-ctx.Done():
				r.t.Fatalf("no leader of stream %s within %s; the look-ups said: %s; the test's NATS connection: %s", stream, limit, strings.Join(seen, "; "), r.natsConnState())
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	for _, s := range r.s.nats {
		if s.Name == leader {
			return s
		}
	}
	r.t.Fatalf("stream %s is led by %q, not one of the run's servers", stream, leader)
	return nil
}

// leaseStream is the JetStream stream behind the lease bucket.
const leaseStream = "KV_" + lease.DefaultBucket

func killNATSNode(r *run, n int) hit {
	s := r.natsLeader(leaseStream, 10*time.Second)
	h := r.everything()
	s.Kill()
	r.logf("SIGKILL nats-server %s, the leader of %s", s.Name, leaseStream)
	time.Sleep(leaseTTL + leaseTTL/2)
	if err := s.Start(); err != nil {
		r.t.Fatalf("start nats-server %s again: %v", s.Name, err)
	}
	return h
}

// restartNATS stops every node of the cluster (SIGTERM: each flushes its
// store) and starts them again together.
func restartNATS(r *run, n int) hit {
	var wg sync.WaitGroup
	for _, s := range r.s.nats {
		wg.Go(s.Stop)
	}
	wg.Wait()
	r.logf("stopped all %d nats-servers", len(r.s.nats))
	errs := make([]error, len(r.s.nats))
	for i, s := range r.s.nats {
		wg.Go(func() { errs[i] = s.Start() }) // a quorum needs the others: start together
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			r.t.Fatalf("start the NATS cluster again: %v", err)
		}
	}
	// A lane can move once kfn's streams have leaders again and the lease
	// bucket takes writes: the heal. (A just-started server may answer a
	// stream look-up from its own stale view, so only a write that a
	// quorum stored counts.)
	back := time.Now()
	for _, stream := range []string{leaseStream, runtime.DefaultStream} {
		r.natsLeader(stream, time.Minute)
	}
	r.leaseBucketTakesWrites(time.Minute)
	r.logf("NATS cluster back; %s and %s had leaders and the lease bucket took a write %s later", leaseStream, runtime.DefaultStream, time.Since(back).Round(time.Millisecond))
	return r.everything()
}

// leaseBucketTakesWrites waits up to limit until a write to the lease
// bucket is stored, under a key no group uses (the bucket's MaxAge
// removes it).
func (r *run) leaseBucketTakesWrites(limit time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	var err error
	for {
		attempt, attemptCancel := context.WithTimeout(ctx, 2*time.Second)
		var kv jetstream.KeyValue
		if kv, err = r.js.KeyValue(attempt, lease.DefaultBucket); err == nil {
			_, err = kv.Put(attempt, "chaos_probe", []byte(time.Now().Format(time.RFC3339Nano)))
		}
		attemptCancel()
		if err == nil {
			return
		}
		select {
		case <-ctx.Done():
			r.t.Fatalf("the lease bucket took no write within %s: %v", limit, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func restartPostgres(r *run, n int) hit {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := r.s.pg.Restart(ctx); err != nil {
		r.t.Fatalf("restart Postgres: %v", err)
	}
	r.logf("Postgres restarted")
	return r.everything()
}

// freezePath freezes the proxied orders worker's path to Postgres for
// 3 TTLs: its lanes must move to the others within about one.
func freezePath(r *run, n int) hit {
	lanes := r.prog.owned([]string{r.s.proxied.id})
	r.s.proxy.Freeze()
	at := time.Now()
	r.logf("froze the path to Postgres of %s, which held %s, for %s", r.s.proxied.id, laneList(lanes), 3*leaseTTL)
	time.Sleep(3 * leaseTTL)
	r.s.proxy.Thaw()
	return hit{at, lanes, []string{r.s.proxied.id}}
}

func killRelay(r *run, n int) hit {
	r.s.mu.Lock()
	v := r.s.relays[n%len(r.s.relays)]
	r.s.mu.Unlock()
	h := r.everything() // the ledger's lanes wait for the relay
	v.Kill()
	r.s.forget(v)
	r.logf("SIGKILL %s", v.id)
	r.s.startRelay()
	return h
}

// replay runs kfn replay on one partition of orders, 200 records back, while
// everything runs: the workers must skip what they handled.
func replay(r *run, n int) hit {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := n % partitions
	var next int64
	if err := r.s.pool.QueryRow(ctx, `SELECT next_offset FROM kfn.cursors WHERE consumer = $1 AND topic = $2 AND partition = $3`, ordersFn, r.s.topic, p).Scan(&next); err != nil {
		r.t.Fatalf("cursor of partition %d: %v", p, err)
	}
	from := max(0, next-200)
	at := time.Now()
	lanes := []lane{{consumer: ordersFn, topic: r.s.topic, partition: p}}
	cmd := exec.CommandContext(ctx, r.s.kfn, "replay", "--function", ordersFn, "--topic", r.s.topic,
		"--partition", strconv.Itoa(p), "--from-offset", strconv.FormatInt(from, 10))
	cmd.Env = r.s.env("chaos-replay", r.s.dbURL)
	out, err := cmd.CombinedOutput()
	if err != nil {
		r.t.Fatalf("kfn replay: %v\n%s", err, out)
	}
	r.logf("kfn replay partition %d from offset %d (cursor was %d)", p, from, next)
	return hit{at: at, lanes: lanes}
}

func poison(r *run, n int) hit {
	r.prod.addPoison()
	r.logf("a poison record (not JSON) goes out with the next tick")
	return r.everything()
}

// victim picks the worker of function to hurt: of those that hold the
// most lanes, the n-th; never the proxied one (the frozen-path fault needs
// it).
func (r *run) victim(function string, n int) *proc {
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	var ps []*proc
	most := -1
	for _, w := range r.s.workers[function] {
		if w == r.s.proxied {
			continue
		}
		switch held := len(r.prog.owned([]string{w.id})); {
		case held > most:
			ps, most = []*proc{w}, held
		case held == most:
			ps = append(ps, w)
		}
	}
	if len(ps) == 0 {
		r.t.Fatalf("no %s worker left to hurt", function)
	}
	return ps[n%len(ps)]
}
