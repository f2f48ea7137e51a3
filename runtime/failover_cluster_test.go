package runtime_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	osexec "os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// The fault tests run real worker processes against real Postgres, a real
// nats-server process and Kafka, with short leases so that failovers are
// quick.
const (
	failoverPartitions = 12
	failoverTTL        = 2 * time.Second
	failoverRenew      = 500 * time.Millisecond
	// produceRate is the records per second the producer writes, spread
	// over all partitions; produceLimit bounds a test's total.
	produceRate  = 300
	produceLimit = 60_000

	effectsWorkerPkg = "github.com/kfn-dev/kfn/internal/effects/cmd/effects-worker"
	naiveWorkerPkg   = "github.com/kfn-dev/kfn/internal/effects/cmd/naive-worker"
)

// cluster is what a fault test needs: Postgres, Kafka, a nats-server
// process, a fresh topic, a function name and the worker processes it
// started.
type cluster struct {
	t     *testing.T
	pg    *kfntest.PG
	kafka *kfntest.KafkaCluster
	nats  *kfntest.NATSServer
	// natsURL is what the workers and the checker connect to: nats's URL,
	// or a cluster's URL list.
	natsURL string
	topic   string
	fn      string
	seq     int // last worker number handed out
	// partitions is the topic's partition count (failoverPartitions unless
	// a test needs fewer).
	partitions int
	// keyLanes, when above 1, runs the workers with that many key-lanes
	// per partition (KFN_KEY_CONCURRENCY); keys, when above 0, makes the
	// producer spread each partition's records over that many keys, with
	// per-key sequence numbers in the values (effects.KeyedValue), and the
	// checker count order per key (effects.KeyOrder).
	keyLanes, keys int
}

func newCluster(t *testing.T) *cluster {
	t.Helper()
	return newClusterOn(t, kfntest.Kafka(t))
}

// newClusterOn is newCluster on a Kafka cluster of the caller's, for tests
// that stop the broker.
func newClusterOn(t *testing.T, kafka *kfntest.KafkaCluster) *cluster {
	t.Helper()
	return newClusterWith(t, kafka, failoverPartitions)
}

// newClusterWith is newClusterOn with a topic of partitions partitions.
func newClusterWith(t *testing.T, kafka *kfntest.KafkaCluster, partitions int) *cluster {
	t.Helper()
	c := &cluster{t: t, pg: kfntest.Postgres(t), kafka: kafka, nats: kfntest.NATSProcess(t), partitions: partitions}
	c.natsURL = c.nats.URL
	c.topic = c.kafka.CreateTopic(t, partitions)
	c.fn = kfntest.Name(t, "fn")
	return c
}

// createEffectsTable runs the function's Setup. Workers run it themselves,
// under a lock, when they start; the naive workers do not take the lock,
// and two of them starting at once can both try to create the table (CREATE
// TABLE IF NOT EXISTS is not safe against itself).
func (c *cluster) createEffectsTable() {
	c.t.Helper()
	setup := effects.Function(c.fn, c.topic).Setup
	if err := pgx.BeginFunc(context.Background(), c.pg.Pool, func(tx pgx.Tx) error { return setup(context.Background(), tx) }); err != nil {
		c.t.Fatalf("create the effects table: %v", err)
	}
}

// proc is one worker process.
type proc struct {
	id      string
	metrics string // the effects-worker's metrics address; empty for naive workers
	*kfntest.Process
}

// nextID returns a worker id not used before in this test.
func (c *cluster) nextID() string {
	c.seq++
	return "w" + strconv.Itoa(c.seq)
}

// startWorker starts an effects-worker process with worker id id, serving
// its metrics on a free loopback port.
func (c *cluster) startWorker(id string) *proc {
	c.t.Helper()
	return c.startWorkerEnv(id)
}

// startWorkerEnv is startWorker with more environment variables, which win
// over the cluster's ("DATABASE_URL=…" through a proxy, "KFN_METRICS_ADDR=…").
func (c *cluster) startWorkerEnv(id string, env ...string) *proc {
	c.t.Helper()
	return c.startWorkerFrom(kfntest.BuildBinary(c.t, effectsWorkerPkg), id, env...)
}

// startWorkerFrom is startWorkerEnv with an effects-worker binary of the
// caller's (built for another schema version, say).
func (c *cluster) startWorkerFrom(bin, id string, env ...string) *proc {
	c.t.Helper()
	// Port 0: the kernel picks a free port and the worker logs it (a port
	// found free beforehand could be taken by another process meanwhile).
	metrics := "127.0.0.1:0"
	cmd := osexec.Command(bin)
	cmd.Env = append(os.Environ(),
		"DATABASE_URL="+c.databaseURL(id),
		"KFN_KAFKA_BROKERS="+strings.Join(c.kafka.Brokers, ","),
		"KFN_NATS_URL="+c.natsURL,
		"KFN_WORKER_ID="+id,
		"KFN_TEST_FUNCTION="+c.fn,
		"KFN_TEST_TOPIC="+c.topic,
		"KFN_LEASE_TTL="+failoverTTL.String(),
		"KFN_LEASE_RENEW="+failoverRenew.String(),
		"KFN_LOG_LEVEL=info",
		"KFN_METRICS_ADDR="+metrics,
	)
	if c.keyLanes > 1 {
		cmd.Env = append(cmd.Env, "KFN_KEY_CONCURRENCY="+strconv.Itoa(c.keyLanes))
	}
	cmd.Env = append(cmd.Env, env...) // the last value of a name wins
	for _, kv := range env {
		if addr, ok := strings.CutPrefix(kv, "KFN_METRICS_ADDR="); ok {
			metrics = addr
		}
	}
	return &proc{id: id, metrics: metrics, Process: kfntest.StartProcess(c.t, cmd)}
}

// duplicates reads from p's metrics how many records it skipped as handled
// before (kfn_records_duplicate_total): what the high-water mark and the
// inbox absorbed, which no effect shows.
func (c *cluster) duplicates(p *proc) int64 {
	c.t.Helper()
	client := http.Client{Timeout: 5 * time.Second}
	var body []byte
	err := errors.New("no metrics address")
	for deadline := time.Now().Add(10 * time.Second); p.metrics != "" && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		addr := p.metricsAddr()
		if addr == "" {
			continue // not serving yet
		}
		var resp *http.Response
		if resp, err = client.Get("http://" + addr + "/metrics"); err != nil {
			continue // not serving yet
		}
		body, err = io.ReadAll(resp.Body)
		resp.Body.Close()
		if err == nil {
			break
		}
	}
	if err != nil {
		c.t.Fatalf("read the metrics of %s: %v", p.id, err)
	}
	// One series per function: sum them.
	const prefix = `kfn_records_duplicate_total{`
	var total float64
	found := false
	for line := range strings.Lines(string(body)) {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, prefix) || !strings.Contains(line, `worker="`+p.id+`"`) {
			continue
		}
		n, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err != nil {
			c.t.Fatalf("metrics of %s: %q: %v", p.id, line, err)
		}
		total, found = total+n, true
	}
	if !found {
		c.t.Fatalf("the metrics of %s have no %s line", p.id, prefix)
	}
	return int64(total)
}

// databaseURL is the test database's URL with application_name set to the
// worker id, so that pg_stat_activity tells the workers' sessions apart.
func (c *cluster) databaseURL(id string) string {
	c.t.Helper()
	u, err := url.Parse(c.pg.URL)
	if err != nil {
		c.t.Fatalf("parse database URL: %v", err)
	}
	q := u.Query()
	q.Set("application_name", id)
	u.RawQuery = q.Encode()
	return u.String()
}

// openTransactions counts the sessions of worker id that are inside a
// transaction, and idle in it if idle is set (as the sessions of a frozen
// worker are once their last statement has finished). With table set, only
// transactions that wrote to that table count: they hold its rows' locks.
func (c *cluster) openTransactions(id string, idle bool, table string) int {
	c.t.Helper()
	var n int
	err := c.pg.Pool.QueryRow(context.Background(), `
SELECT count(*) FROM pg_stat_activity a
 WHERE a.datname = current_database() AND a.application_name = $1 AND a.xact_start IS NOT NULL
   AND (NOT $2 OR a.state = 'idle in transaction')
   AND ($3 = '' OR EXISTS (SELECT FROM pg_locks l
                            WHERE l.pid = a.pid AND l.relation = to_regclass($3) AND l.mode = 'RowExclusiveLock'))`,
		id, idle, table).Scan(&n)
	if err != nil {
		c.t.Fatalf("read pg_stat_activity: %v", err)
	}
	return n
}

// killInTransaction SIGKILLs one of ps while it is inside a transaction that
// has passed its fence (it holds a cursor row's lock, so it owns partitions
// and has uncommitted work on one): it freezes a worker there with
// pauseInTransaction, trying them in random order, and kills it frozen.
// It returns the index of the victim and when it was frozen; it fails the
// test if none was caught within limit.
func (c *cluster) killInTransaction(ps []*proc, limit time.Duration) (int, time.Time) {
	c.t.Helper()
	return c.killInTransactionOn(ps, "kfn.cursors", limit)
}

// startLoad starts n workers and the producer, and waits until the
// workers share the partitions.
func (c *cluster) startLoad(n int) ([]*proc, *producer) {
	c.t.Helper()
	workers := c.startWorkers(n)
	prod := c.startProducer()
	c.waitBalanced(ids(workers), 30*time.Second)
	return workers, prod
}

// finishLoad stops the producer, waits until every record it had
// acknowledged is applied, stops workers (each must exit cleanly), and
// returns the high-water marks it waited for, for c.check.
func (c *cluster) finishLoad(prod *producer, workers ...*proc) map[int]int64 {
	c.t.Helper()
	hw := c.finishProduction(prod)
	c.waitCaughtUp(hw, 60*time.Second)
	stopClean(c.t, workers...)
	return hw
}

// killed is one kill of killAndReplace: the victim's id, the partitions it
// owned, and how long from the moment it was frozen until a new owner
// committed on one of them.
type killed struct {
	victim     string
	partitions []int
	stoodStill time.Duration
}

// killAndReplace SIGKILLs one of workers inside a transaction that wrote
// table (killInTransactionOn), waits up to limit for a new owner to commit
// past where it stood on one of its partitions, then puts a new worker in
// its place in workers and waits for the partitions to be balanced again.
func (c *cluster) killAndReplace(workers []*proc, table string, limit time.Duration) killed {
	c.t.Helper()
	vi, frozen := c.killInTransactionOn(workers, table, 30*time.Second)
	k := killed{victim: workers[vi].id}
	before := ownedBy(c.cursors(), k.victim)
	if len(before) == 0 {
		c.t.Fatalf("victim %s owned no partition", k.victim)
	}
	k.partitions = slices.Sorted(maps.Keys(before))
	waitFor(c.t, limit, "a new owner to commit on one of "+k.victim+"'s partitions", func() bool {
		curs := c.cursors()
		for p, old := range before {
			if cur := curs[p]; cur.owner != k.victim && cur.committed && cur.next > old.next {
				k.stoodStill = time.Since(frozen)
				return true
			}
		}
		return false
	})
	workers[vi] = c.startWorker(c.nextID())
	c.waitBalanced(ids(workers), 30*time.Second)
	return k
}

// killInTransactionOn is killInTransaction for a transaction that wrote
// table (kfn.key_lanes: a key-lane's, past its fence).
func (c *cluster) killInTransactionOn(ps []*proc, table string, limit time.Duration) (int, time.Time) {
	c.t.Helper()
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) {
		for _, i := range rand.Perm(len(ps)) {
			if frozen, ok := c.freezeInTransaction(ps[i], table, 2*time.Second); ok {
				ps[i].Kill()
				return i, frozen
			}
		}
	}
	c.t.Fatalf("caught none of %v inside a fenced transaction (one that wrote %s) within %s", ids(ps), table, limit)
	return 0, time.Time{}
}

// pauseInTransaction freezes p (SIGSTOP) at the worst moment for a
// failover: inside one of its transactions, and with table set, after it
// wrote to table (for kfn.cursors: after the UPDATE that fences the batch,
// before COMMIT, so the frozen session holds the cursor row's lock). It
// polls pg_stat_activity for such a transaction, stops p, and keeps it
// stopped only if that session is then idle in the transaction; otherwise
// it lets p run and tries again. It reports false, with p running, if it
// did not succeed within limit.
func (c *cluster) pauseInTransaction(p *proc, table string, limit time.Duration) bool {
	c.t.Helper()
	_, ok := c.freezeInTransaction(p, table, limit)
	return ok
}

// freezeInTransaction is pauseInTransaction that also returns when p was
// frozen.
func (c *cluster) freezeInTransaction(p *proc, table string, limit time.Duration) (time.Time, bool) {
	c.t.Helper()
	deadline := time.Now().Add(limit)
	for attempt := 1; time.Now().Before(deadline); attempt++ {
		if c.openTransactions(p.id, false, table) == 0 {
			time.Sleep(time.Millisecond)
			continue
		}
		p.Pause()
		frozen := time.Now()
		time.Sleep(20 * time.Millisecond) // let a statement it had sent finish
		if c.openTransactions(p.id, true, table) > 0 {
			c.t.Logf("%s frozen inside a transaction (attempt %d)", p.id, attempt)
			return frozen, true
		}
		p.Resume()
		time.Sleep(randomDuration(0, 50*time.Millisecond))
	}
	return time.Time{}, false
}

// blockedSessions describes the sessions of the test database that wait
// for a lock or sit idle inside a transaction, for failure messages.
func (c *cluster) blockedSessions() string {
	c.t.Helper()
	rows, err := c.pg.Pool.Query(context.Background(), `
SELECT format('%s: %s%s for %s, pid %s blocked by %s: %s', application_name, state,
              coalesce(' on ' || wait_event_type, ''), date_trunc('millisecond', now() - state_change),
              pid, pg_blocking_pids(pid), left(regexp_replace(query, '\s+', ' ', 'g'), 80))
  FROM pg_stat_activity
 WHERE datname = current_database() AND (state = 'idle in transaction' OR wait_event_type = 'Lock')
 ORDER BY application_name`)
	if err != nil {
		return "(pg_stat_activity: " + err.Error() + ")"
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return "(pg_stat_activity: " + err.Error() + ")"
	}
	if len(lines) == 0 {
		return "no session waits for a lock or idles in a transaction"
	}
	return strings.Join(lines, "\n")
}

// startWorkers starts n workers with fresh ids.
func (c *cluster) startWorkers(n int) []*proc {
	c.t.Helper()
	ps := make([]*proc, n)
	for i := range ps {
		ps[i] = c.startWorker(c.nextID())
	}
	return ps
}

// startNaive starts a naive-worker process (consumer group, no inbox, no
// fence) with worker id id.
func (c *cluster) startNaive(id string) *proc {
	c.t.Helper()
	cmd := osexec.Command(kfntest.BuildBinary(c.t, naiveWorkerPkg))
	cmd.Env = append(os.Environ(),
		"DATABASE_URL="+c.databaseURL(id),
		"KFN_KAFKA_BROKERS="+strings.Join(c.kafka.Brokers, ","),
		"KFN_WORKER_ID="+id,
		"KFN_TEST_FUNCTION="+c.fn,
		"KFN_TEST_TOPIC="+c.topic,
	)
	return &proc{id: id, Process: kfntest.StartProcess(c.t, cmd)}
}

func ids(ps []*proc) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.id
	}
	return out
}

// frozenZombie is a worker frozen inside a transaction (as a SIGSTOP
// would) whose partitions the other workers have taken over.
type frozenZombie struct {
	c      *cluster
	p      *proc
	paused time.Time
	// before holds the zombie's cursors when it froze, and oldTokens
	// their epochs; takeover is how long after the freeze every one of
	// them had moved under another owner.
	before    map[int]cursor
	oldTokens []int64
	takeover  time.Duration
	// oldRows counts the inbox rows under the old tokens when it woke;
	// dropLog is what it logged from its wake until it had stopped every
	// old term.
	oldRows int
	dropLog []logEntry
}

// freezeZombie freezes one of workers, at random, inside a transaction
// that holds a row of table, checks that it owned `owned` partitions, and
// waits (what) until other workers own each of them under a newer token
// and have committed past where it stood, which must not be before its
// leases could have expired.
func (c *cluster) freezeZombie(workers []*proc, table string, owned int, what string) *frozenZombie {
	t := c.t
	t.Helper()
	z := &frozenZombie{c: c, p: workers[rand.N(len(workers))]}
	if !c.pauseInTransaction(z.p, table, 30*time.Second) {
		t.Fatalf("could not freeze %s inside a transaction that holds a row of %s within 30s", z.p.id, table)
	}
	z.paused = time.Now()
	z.before = ownedBy(c.cursors(), z.p.id)
	if len(z.before) != owned {
		t.Fatalf("the zombie %s owned %d partitions when it was frozen, want %d", z.p.id, len(z.before), owned)
	}
	for _, cur := range z.before {
		z.oldTokens = append(z.oldTokens, cur.epoch)
	}
	waitUntil(t, failoverTTL+15*time.Second, what, func() (bool, string) {
		curs := c.cursors()
		for p, old := range z.before {
			if cur := curs[p]; cur.owner == z.p.id || cur.epoch <= old.epoch || !cur.committed || cur.next <= old.next {
				why := fmt.Sprintf("partition %d: %+v (at the pause: %+v)", p, cur, old)
				if time.Since(z.paused) > failoverTTL+5*time.Second {
					why += "\nsessions:\n" + c.blockedSessions()
				}
				return false, why
			}
		}
		return true, ""
	})
	z.takeover = time.Since(z.paused)
	if z.takeover < failoverTTL-failoverRenew {
		t.Fatalf("the zombie's partitions were taken over %s after the pause, before its leases could have expired (TTL %s, renewed every %s)", z.takeover, failoverTTL, failoverRenew)
	}
	return z
}

// wake lets records pile up on the zombie's old partitions for a second,
// wakes it, and waits until it has logged that it stopped each old term:
// its lease watchdog (validity ran out), a renewal (key taken) or Postgres
// (a fenced commit) stops each one.
func (z *frozenZombie) wake() {
	t := z.c.t
	t.Helper()
	time.Sleep(time.Second)
	z.oldRows = z.c.inboxRowsWithEpochs(z.oldTokens)
	mark := logSize(t, z.p)
	z.p.Resume()
	t.Logf("zombie %s paused %s (partitions %v, tokens %v); taken over after %s",
		z.p.id, time.Since(z.paused).Round(time.Millisecond), slices.Sorted(maps.Keys(z.before)), z.oldTokens, z.takeover.Round(time.Millisecond))
	waitFor(t, 10*time.Second, "the zombie to log that it stopped each of its old terms", func() bool {
		z.dropLog = logSince(t, z.p, mark)
		for p, old := range z.before {
			if !slices.ContainsFunc(z.dropLog, func(e logEntry) bool { return droppedTerm(e, p, old.epoch) }) {
				return false
			}
		}
		return true
	})
}

// finish lets the woken zombie rejoin, stops production and the workers
// once every acknowledged record is applied, checks that the zombie
// committed nothing under its old tokens after it woke, and returns the
// high-water marks for the check of every record.
func (z *frozenZombie) finish(workers []*proc, prod *producer) map[int]int64 {
	t := z.c.t
	t.Helper()
	z.c.waitBalanced(ids(workers), 30*time.Second)
	requireAlive(t, workers...)
	hw := z.c.finishLoad(prod, workers...)
	if n := z.c.inboxRowsWithEpochs(z.oldTokens); n != z.oldRows {
		t.Errorf("the zombie committed %d records under its old tokens after it woke", n-z.oldRows)
	}
	return hw
}

// requireAlive fails the test if a process has exited.
func requireAlive(t *testing.T, ps ...*proc) {
	t.Helper()
	for _, p := range ps {
		select {
		case <-p.Exited():
			t.Fatalf("worker %s exited (%v); output:\n%s", p.id, p.ExitErr(), p.LogTail(40))
		default:
		}
	}
}

// stopClean stops the processes with SIGTERM, all at once, and requires
// each to exit with status 0.
func stopClean(t *testing.T, ps ...*proc) {
	t.Helper()
	var wg sync.WaitGroup
	for _, p := range ps {
		wg.Go(p.Stop)
	}
	wg.Wait()
	for _, p := range ps {
		if err := p.ExitErr(); err != nil {
			t.Errorf("worker %s exited with %v on SIGTERM; output:\n%s", p.id, err, p.LogTail(40))
		}
	}
}

// producer writes produceRate records per second, round-robin over the
// partitions, until stopped or produceLimit is reached. It never fails the
// test from its goroutine: stop reports what went wrong.
type producer struct {
	stopOnce sync.Once
	stopCh   chan struct{}
	done     chan struct{}
	acked    atomic.Int64
	errs     atomic.Int64
	lastErr  atomic.Value
	// expectErrors is set by tests that stop Kafka: failed writes are then
	// counted in expected, not errs.
	expectErrors atomic.Bool
	expected     atomic.Int64
	// paused makes the producer skip its ticks (pause, resume); writing is
	// held while a write is in flight.
	paused  atomic.Bool
	writing sync.Mutex
}

func (c *cluster) startProducer() *producer {
	c.t.Helper()
	p := &producer{stopCh: make(chan struct{}), done: make(chan struct{})}
	// A transport of its own: kafka-go's default transport is shared by the
	// test binary and keeps asking for metadata of topics that earlier
	// tests deleted, which fails writes with UnknownTopicOrPartition.
	// It refreshes its metadata every second (kafka-go's default is 6 s, and
	// a failed write does not refresh it), so that it finds a partition's
	// new leader soon after a broker dies.
	transport := &kafka.Transport{DialTimeout: 5 * time.Second, MetadataTTL: time.Second}
	w := &kafka.Writer{
		Transport:    transport,
		Addr:         kafka.TCP(c.kafka.Brokers...),
		Topic:        c.topic,
		Balancer:     kafka.BalancerFunc(func(m kafka.Message, _ ...int) int { return m.Partition }),
		RequiredAcks: kafka.RequireAll,
		BatchSize:    produceRate,
		BatchTimeout: time.Millisecond,
		WriteTimeout: 10 * time.Second,
	}
	const tick = 50 * time.Millisecond
	perTick := produceRate * int(tick) / int(time.Second)
	go func() {
		defer close(p.done)
		defer transport.CloseIdleConnections()
		defer w.Close()
		t := time.NewTicker(tick)
		defer t.Stop()
		next := 0
		seqs := map[string]int{} // per key, with c.keys
		for sent := 0; sent < produceLimit; {
			select {
			case <-p.stopCh:
				return
			case <-t.C:
			}
			p.writing.Lock()
			if p.paused.Load() {
				p.writing.Unlock()
				continue
			}
			msgs := make([]kafka.Message, perTick)
			for i := range msgs {
				part := next % c.partitions
				msgs[i] = kafka.Message{Partition: part, Key: []byte("k" + strconv.Itoa(part)), Value: []byte("v" + strconv.Itoa(next))}
				if c.keys > 0 {
					key := fmt.Sprintf("k%d-%d", part, (next/c.partitions)%c.keys)
					seqs[key]++
					msgs[i].Key, msgs[i].Value = []byte(key), effects.KeyedValue(key, seqs[key])
				}
				next++
			}
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			err := w.WriteMessages(ctx, msgs...)
			cancel()
			p.writing.Unlock()
			if err != nil {
				if p.expectErrors.Load() {
					p.expected.Add(1)
					continue
				}
				p.errs.Add(1)
				p.lastErr.Store(err.Error())
				continue
			}
			p.acked.Add(int64(len(msgs)))
			sent += len(msgs)
		}
	}()
	c.t.Cleanup(func() { p.stop() })
	return p
}

// pause stops production until resume; it returns once no write is in
// flight.
func (p *producer) pause() {
	p.paused.Store(true)
	p.writing.Lock() // waits for the write in flight; later ones see paused
	p.writing.Unlock()
}

// resume ends a pause.
func (p *producer) resume() { p.paused.Store(false) }

// stop ends production and returns how many records were acknowledged.
func (p *producer) stop() int64 {
	p.stopOnce.Do(func() { close(p.stopCh) })
	<-p.done
	return p.acked.Load()
}

// finishProduction stops the producer, requires that it wrote without
// errors, and returns the high watermarks: every produced record is in
// [0, hw) of its partition, since the topic is the test's own.
func (c *cluster) finishProduction(p *producer) map[int]int64 {
	c.t.Helper()
	acked := p.stop()
	if n := p.errs.Load(); n > 0 {
		c.t.Errorf("producer: %d writes failed, last: %v", n, p.lastErr.Load())
	}
	hw := c.kafka.HighWatermarks(c.t, c.topic)
	var total int64
	for part, end := range hw {
		if end == 0 {
			c.t.Fatalf("partition %d got no records; the producer did not run", part)
		}
		total += end
	}
	if total < acked {
		c.t.Fatalf("the topic holds %d records but the producer had %d acknowledged", total, acked)
	}
	c.t.Logf("produced %d records (%d acknowledged) over %d partitions", total, acked, len(hw))
	return hw
}

// producedUpTo lists every record below the high watermarks.
func producedUpTo(hw map[int]int64) []effects.Produced {
	var out []effects.Produced
	for part, end := range hw {
		for o := int64(0); o < end; o++ {
			out = append(out, effects.Produced{Partition: int32(part), Offset: o})
		}
	}
	return out
}

// cursor is a row of kfn.cursors.
type cursor struct {
	partition int
	owner     string
	epoch     int64
	next      int64
	committed bool // the current owner has committed since it claimed the partition
}

// cursors reads the function's cursors, indexed by partition.
func (c *cluster) cursors() map[int]cursor {
	c.t.Helper()
	out, err := c.readCursors()
	if err != nil {
		c.t.Fatal(err)
	}
	return out
}

// readCursors is cursors, returning its error (Postgres restarting).
func (c *cluster) readCursors() (map[int]cursor, error) {
	rows, err := c.pg.Pool.Query(context.Background(), `
SELECT partition, owner, epoch, next_offset, updated_at > claimed_at
  FROM kfn.cursors WHERE consumer = $1 AND topic = $2`, c.fn, c.topic)
	if err != nil {
		return nil, fmt.Errorf("read cursors: %w", err)
	}
	out := map[int]cursor{}
	var cur cursor
	_, err = pgx.ForEachRow(rows, []any{&cur.partition, &cur.owner, &cur.epoch, &cur.next, &cur.committed}, func() error {
		out[cur.partition] = cur
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read cursors: %w", err)
	}
	return out, nil
}

// ownedBy returns the cursors whose owner is id.
func ownedBy(curs map[int]cursor, id string) map[int]cursor {
	out := map[int]cursor{}
	for p, cur := range curs {
		if cur.owner == id {
			out[p] = cur
		}
	}
	return out
}

// balanced reports whether the live workers own every partition, none
// more than its share (the lease manager's load bound), and each owner has
// committed since its claim. It returns a description of what is not so.
func balanced(curs map[int]cursor, live []string, partitions int) (bool, string) {
	if len(curs) < partitions {
		return false, fmt.Sprintf("%d of %d partitions have a cursor", len(curs), partitions)
	}
	share := (partitions + len(live) - 1) / len(live)
	count := map[string]int{}
	for p, cur := range curs {
		if !slices.Contains(live, cur.owner) {
			return false, fmt.Sprintf("partition %d is owned by %s, not a live worker %v", p, cur.owner, live)
		}
		if !cur.committed {
			return false, fmt.Sprintf("partition %d: owner %s has not committed since its claim", p, cur.owner)
		}
		count[cur.owner]++
	}
	for id, n := range count {
		if n > share {
			return false, fmt.Sprintf("%s owns %d partitions, more than its share %d (%v)", id, n, share, count)
		}
	}
	return true, ""
}

// waitBalanced waits until balanced holds, and still holds 500 ms later.
func (c *cluster) waitBalanced(live []string, limit time.Duration) {
	c.t.Helper()
	c.waitStable(limit, fmt.Sprintf("workers %v to own all partitions, balanced", live), func() (bool, string) {
		return balanced(c.cursors(), live, c.partitions)
	})
}

// waitStable polls cond until it has held for 500 ms without a break.
func (c *cluster) waitStable(limit time.Duration, what string, cond func() (bool, string)) {
	c.t.Helper()
	waitHeld(c.t, limit, 500*time.Millisecond, what, cond)
}

// waitUntil polls cond until it holds; on timeout it says why it did not.
func waitUntil(t *testing.T, limit time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	waitHeld(t, limit, 0, what, cond)
}

// waitHeld polls cond every 20 ms until it has held for hold without a
// break, and fails the test with cond's last reason after limit.
func waitHeld(t *testing.T, limit, hold time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(limit)
	var since time.Time
	last := ""
	for {
		ok, why := cond()
		switch {
		case !ok:
			since, last = time.Time{}, why
		case since.IsZero():
			since = time.Now()
		}
		if ok && time.Since(since) >= hold {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s: %s", limit, what, last)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitCaughtUp waits until every cursor reaches its high watermark.
func (c *cluster) waitCaughtUp(hw map[int]int64, limit time.Duration) {
	c.t.Helper()
	start := time.Now()
	waitUntil(c.t, limit, "cursors to reach the high watermarks", func() (bool, string) {
		curs := c.cursors()
		for p, end := range hw {
			if cur, ok := curs[p]; !ok || cur.next < end {
				return false, fmt.Sprintf("partition %d at %d of %d (%+v)", p, cur.next, end, cur)
			}
		}
		return true, ""
	})
	c.t.Logf("caught up %s after production stopped", time.Since(start).Round(time.Millisecond))
}

// check runs the checker over every produced record, with the events in
// the nats-server's event stream, and requires every count to be zero and
// the dead-lettered records to be exactly dead (none if omitted).
func (c *cluster) check(hw map[int]int64, dead ...effects.Produced) effects.Report {
	c.t.Helper()
	// A read that fails is tried again: a NATS cluster that lost a server
	// may refuse a request while it settles (no responders).
	js := jetStream(c.t, c.natsURL)
	var rep effects.Report
	waitUntil(c.t, 30*time.Second, "the checker to read Postgres and the event stream", func() (bool, string) {
		var err error
		opts := []effects.Option{effects.Events(js, runtime.DefaultStream)}
		if c.keys > 0 {
			opts = append(opts, effects.KeyOrder())
		}
		rep, err = effects.Check(context.Background(), c.pg.Pool, c.fn, c.topic, producedUpTo(hw), opts...)
		if err != nil {
			c.t.Logf("checker: %v (trying again)", err)
			time.Sleep(500 * time.Millisecond)
			return false, err.Error()
		}
		return true, ""
	})
	c.t.Logf("checker: %s", rep)
	if v := rep.Violations(dead...); len(v) > 0 || rep.Expected == 0 {
		c.t.Errorf("exactly-once violated (of %d records): %s", rep.Expected, strings.Join(v, "; "))
	}
	return rep
}

// logEntry is one JSON log line of a worker.
type logEntry map[string]any

func (e logEntry) str(key string) string {
	switch v := e[key].(type) {
	case string:
		return v
	case json.Number:
		return v.String()
	case nil:
		return ""
	default:
		return fmt.Sprint(v)
	}
}

// logSize is the current length of a process's log, to read what it
// writes from then on with logSince.
func logSize(t *testing.T, p *proc) int64 {
	t.Helper()
	fi, err := os.Stat(p.LogFile)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

// logSince returns the JSON log lines p wrote from byte offset from on.
func logSince(t *testing.T, p *proc, from int64) []logEntry {
	t.Helper()
	data, err := os.ReadFile(p.LogFile)
	if err != nil {
		t.Fatal(err)
	}
	var out []logEntry
	sc := bufio.NewScanner(bytes.NewReader(data[min(from, int64(len(data))):]))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		d := json.NewDecoder(bytes.NewReader(sc.Bytes()))
		d.UseNumber()
		var e logEntry
		if d.Decode(&e) == nil {
			out = append(out, e)
		}
	}
	return out
}

// randomDuration is uniform in [lo, hi).
func randomDuration(lo, hi time.Duration) time.Duration {
	return lo + rand.N(hi-lo)
}

// The checker must catch every kind of violation the tests rely on it
// for, including those kfn's dedup layers would hide. A clean scenario is
// written by hand (effect rows with their tokens and commit positions, the
// claim history, dead letters, outbox rows and stream messages) and must
// pass; then each case injects one violation into it, and the checker must
// report that one and nothing else.
func TestFailoverCheckerCountsEveryViolation(t *testing.T) {
	pg := kfntest.Postgres(t)
	js := jetStream(t, kfntest.NATSURL(t))
	ctx := context.Background()

	cases := []struct {
		name   string
		inject func(s *checkScenario)
		count  func(r effects.Report) int // the report's count for the violation; nil: only dead letters
		want   string                     // what Violations says
	}{
		{"clean", func(*checkScenario) {}, nil, ""},
		{"lost", func(s *checkScenario) { s.drop(0, 2) }, func(r effects.Report) int { return r.Lost }, "1 lost"},
		{"duplicated", func(s *checkScenario) {
			s.effects = append(s.effects, checkEffect{p: 0, o: 1, token: 5, fenced: true, lsn: 0x190})
		}, func(r effects.Report) int { return r.Duplicated }, "1 duplicated"},
		{"unexpected", func(s *checkScenario) {
			s.effects = append(s.effects, checkEffect{p: 0, o: 9, token: 5, fenced: true, lsn: 0x190})
			s.stream = append(s.stream, s.event(0, 9))
		}, func(r effects.Report) int { return r.Unexpected }, "1 unexpected"},
		{"reordered by commit order", func(s *checkScenario) {
			// Inserted (ids) in offset order, committed (lsn) 1 after 2.
			s.find(1, 1).lsn, s.find(1, 2).lsn = s.find(1, 2).lsn, s.find(1, 1).lsn
		}, func(r effects.Report) int { return r.Reordered }, "1 reordered"},
		{"stale token hidden by the inbox", func(s *checkScenario) {
			// A new owner claims partition 0 with epoch 7 before the old
			// owner's last commit (offset 2, token 5) lands; the new owner
			// then skips offset 2, which its inbox shows as handled. Each
			// record has one effect, and the inbox's epochs (5, 5, 5) do
			// not go backwards: only the claim history shows it.
			s.claims = append(s.claims, checkClaim{p: 0, epoch: 7, lsn: 0x125})
			s.inbox = true
		}, func(r effects.Report) int { return r.StaleEpochs }, "1 stale-token commits"},
		{"unfenced", func(s *checkScenario) { s.find(1, 0).fenced = false }, func(r effects.Report) int { return r.Unfenced }, "1 unfenced"},
		{"good record dead-lettered", func(s *checkScenario) {
			s.drop(0, 1)
			s.dead = append(s.dead, effects.Produced{Partition: 0, Offset: 1})
		}, nil, "1 dead-lettered that should not be: 0@1"},
		{"bad record applied", func(s *checkScenario) {
			s.wantDead = append(s.wantDead, effects.Produced{Partition: 1, Offset: 2})
		}, nil, "1 not dead-lettered that should be: 1@2"},
		{"missing event", func(s *checkScenario) { s.stream = slices.Delete(s.stream, 0, 1) }, func(r effects.Report) int { return r.MissingEvents }, "1 missing events"},
		{"extra event", func(s *checkScenario) { s.stream = append(s.stream, s.event(1, 7)) }, func(r effects.Report) int { return r.ExtraEvents }, "1 extra events"},
		{"duplicated event", func(s *checkScenario) {
			ev := s.event(0, 1)
			ev.id = outbox.EventID(s.fn, outbox.KafkaSourceID(s.topic, 0, 1), 1) // a second event for one record
			s.stream = append(s.stream, ev)
		}, func(r effects.Report) int { return r.DuplicatedEvents }, "1 duplicated events"},
		{"event with the wrong data", func(s *checkScenario) { s.stream[1].data = []byte("other") }, func(r effects.Report) int { return r.WrongEvents }, "1 events with the wrong data"},
		{"reordered event", func(s *checkScenario) {
			s.stream[3], s.stream[4] = s.stream[4], s.stream[3] // 1@0 and 1@1, one key
		}, func(r effects.Report) int { return r.ReorderedEvents }, "1 reordered events"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newCheckScenario(fmt.Sprintf("checked%d", i), "t")
			tc.inject(s)
			s.write(t, pg, js)
			rep, err := effects.Check(ctx, pg.Pool, s.fn, s.topic, s.produced, effects.Events(js, s.stream0))
			if err != nil {
				t.Fatal(err)
			}
			v := rep.Violations(s.wantDead...)
			t.Logf("%s\nviolations: %v", rep, v)
			if tc.want == "" {
				if len(v) != 0 || !rep.OK(s.wantDead...) || rep.Applied != 6 || rep.Events != 6 || !rep.EventsChecked {
					t.Errorf("clean scenario: violations %v, report %s; want none, 6 effects and 6 events", v, rep)
				}
				return
			}
			if len(v) != 1 || !strings.HasPrefix(v[0], tc.want) || rep.OK(s.wantDead...) {
				t.Errorf("violations = %q, want exactly %q", v, tc.want)
			}
			if tc.count != nil && tc.count(rep) != 1 {
				t.Errorf("count = %d, want 1", tc.count(rep))
			}
		})
	}
}

// checkScenario is what a function run leaves behind, written by hand for
// the checker's self-test. The clean version: partitions 0 and 1, offsets
// 0-2 each, all applied once in order by the owner of epoch 5 (partition
// 0) and 3 (partition 1), each with its event in the stream.
type checkScenario struct {
	fn, topic, stream0 string
	produced           []effects.Produced
	effects            []checkEffect
	claims             []checkClaim
	dead, wantDead     []effects.Produced
	outboxRows         []checkEvent // events not relayed yet
	stream             []checkEvent // events in the stream, in stream order
	inbox              bool         // write inbox rows as kfn would (epoch of the effect)
}

type checkEffect struct {
	p      int32
	o      int64
	token  int64
	fenced bool
	lsn    int64
}

type checkClaim struct {
	p     int32
	epoch int64
	lsn   int64
}

type checkEvent struct {
	id   string
	p    int32
	o    int64
	data []byte
}

func newCheckScenario(fn, topic string) *checkScenario {
	s := &checkScenario{fn: fn, topic: topic, stream0: strings.ToUpper(fn)}
	for p, epoch := range []int64{5, 3} {
		s.claims = append(s.claims, checkClaim{p: int32(p), epoch: epoch, lsn: 0x100})
		for o := range int64(3) {
			s.produced = append(s.produced, effects.Produced{Partition: int32(p), Offset: o})
			s.effects = append(s.effects, checkEffect{p: int32(p), o: o, token: epoch, fenced: true, lsn: 0x110 + 0x10*o})
			s.stream = append(s.stream, s.event(int32(p), o))
		}
	}
	// One event still in the outbox as well: published, not yet deleted.
	s.outboxRows = append(s.outboxRows, s.event(1, 2))
	return s
}

func (s *checkScenario) value(p int32, o int64) []byte { return fmt.Appendf(nil, "v-%d-%d", p, o) }

func (s *checkScenario) event(p int32, o int64) checkEvent {
	return checkEvent{id: outbox.EventID(s.fn, outbox.KafkaSourceID(s.topic, p, o), 0), p: p, o: o, data: s.value(p, o)}
}

func (s *checkScenario) find(p int32, o int64) *checkEffect {
	for i := range s.effects {
		if s.effects[i].p == p && s.effects[i].o == o {
			return &s.effects[i]
		}
	}
	panic("no such effect")
}

// drop removes the effect and the events of one record.
func (s *checkScenario) drop(p int32, o int64) {
	s.effects = slices.DeleteFunc(s.effects, func(e checkEffect) bool { return e.p == p && e.o == o })
	is := func(e checkEvent) bool { return e.p == p && e.o == o }
	s.stream = slices.DeleteFunc(s.stream, is)
	s.outboxRows = slices.DeleteFunc(s.outboxRows, is)
}

func (s *checkScenario) write(t *testing.T, pg *kfntest.PG, js jetstream.JetStream) {
	t.Helper()
	ctx := context.Background()
	lsn := func(n int64) string { return fmt.Sprintf("0/%X", n) }
	err := pgx.BeginFunc(ctx, pg.Pool, func(tx pgx.Tx) error {
		if err := effects.Function(s.fn, s.topic).Setup(ctx, tx); err != nil {
			return err
		}
		for _, e := range s.effects {
			_, err := tx.Exec(ctx, `INSERT INTO `+effects.Table(s.fn)+` (topic, partition, "offset", key, value, attempt, token, fenced, lsn)
VALUES ($1, $2, $3, $4, $5, 1, $6, $7, $8::pg_lsn)`, s.topic, e.p, e.o, fmt.Appendf(nil, "k%d", e.p), s.value(e.p, e.o), e.token, e.fenced, lsn(e.lsn))
			if err != nil {
				return err
			}
			if s.inbox {
				err := inbox.AddLane(ctx, tx, inbox.Partition{Consumer: s.fn, Topic: s.topic, Partition: e.p})
				if err == nil {
					_, err = tx.Exec(ctx, `INSERT INTO kfn.inbox (lane, "offset", epoch) SELECT id, $4, $5 FROM kfn.lanes WHERE consumer = $1 AND topic = $2 AND partition = $3`, s.fn, s.topic, e.p, e.o, e.token)
				}
				if err != nil {
					return err
				}
			}
		}
		for _, c := range s.claims {
			_, err := tx.Exec(ctx, `INSERT INTO kfn.audit_log (actor, action, consumer, topic, partition, details)
VALUES ('w', $1, $2, $3, $4, jsonb_build_object('epoch', $5::bigint, 'owner', 'w', 'lsn', $6::text))`, inbox.ActionClaim, s.fn, s.topic, c.p, c.epoch, lsn(c.lsn))
			if err != nil {
				return err
			}
		}
		for _, d := range s.dead {
			_, err := tx.Exec(ctx, `INSERT INTO kfn.dead_letters (consumer, topic, partition, "offset", reason, error, attempts) VALUES ($1, $2, $3, $4, 'permanent', 'bad', 1)`, s.fn, s.topic, d.Partition, d.Offset)
			if err != nil {
				return err
			}
		}
		var rows []outbox.Row
		for _, e := range s.outboxRows {
			rows = append(rows, s.row(e))
		}
		return outbox.Insert(ctx, tx, rows)
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: s.stream0, Subjects: []string{effects.Subject(s.fn)}}); err != nil {
		t.Fatal(err)
	}
	for _, e := range s.stream {
		r := s.row(e)
		msg := nats.NewMsg(r.Event.Subject)
		msg.Data = r.Event.Data
		msg.Header.Set(jetstream.MsgIDHeader, r.EventID)
		msg.Header.Set(outbox.HeaderSource, outbox.CloudEventsSourcePrefix+s.fn)
		msg.Header.Set(outbox.HeaderKey, r.Event.Key)
		msg.Header.Set(outbox.HeaderSourceTopic, s.topic)
		msg.Header.Set(outbox.HeaderSourcePartition, strconv.Itoa(int(e.p)))
		msg.Header.Set(outbox.HeaderSourceOffset, strconv.FormatInt(e.o, 10))
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
}

// row is the outbox row of an event, as the test function emits it.
func (s *checkScenario) row(e checkEvent) outbox.Row {
	origin := outbox.Origin{Consumer: s.fn, Topic: s.topic, Partition: e.p, Offset: e.o, SourceID: outbox.KafkaSourceID(s.topic, e.p, e.o)}
	r := outbox.NewRow(origin, 0, fmt.Sprintf("k%d", e.p), outbox.Event{Subject: effects.Subject(s.fn), Data: e.data})
	r.EventID = e.id
	return r
}

// servingMetrics is the worker's log line that says where its metrics are.
var servingMetrics = regexp.MustCompile(`"msg":"serving metrics"[^\n]*"addr":"([^"]+)"`)

// metricsAddr is where p serves its metrics: the address it was given, or
// for port 0 the one it logged; "" until it has.
func (p *proc) metricsAddr() string {
	if !strings.HasSuffix(p.metrics, ":0") {
		return p.metrics
	}
	data, err := os.ReadFile(p.LogFile)
	if err != nil {
		return ""
	}
	if m := servingMetrics.FindSubmatch(data); m != nil {
		return string(m[1])
	}
	return ""
}
