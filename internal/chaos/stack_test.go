//go:build chaos

package chaos_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/internal/devstack"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// The run's timing: short leases, so that a fault's lanes move in seconds,
// as in the other fault tests.
const (
	leaseTTL   = 2 * time.Second
	leaseRenew = 500 * time.Millisecond

	partitions  = 6 // of the orders topic
	ledgerLanes = 4
	perStage    = 3 // worker processes of each function
	relays      = 2 // kfn relay processes

	ordersPkg = "github.com/kfn-dev/kfn/functions/orders/cmd/orders"
	ledgerPkg = "github.com/kfn-dev/kfn/functions/ledger/cmd/ledger"
	kfnPkg    = "github.com/kfn-dev/kfn/cmd/kfn"

	ordersFn = "orders" // the orders function's name
)

// stack is the whole deployment under test: a Postgres of its own (so it
// can be restarted), a freezable proxy in front of it for one orders
// worker, a 3-node NATS cluster, Kafka, and the worker and relay processes.
type stack struct {
	t        *testing.T
	pg       *devstack.Postgres
	dbURL    string
	proxyURL string
	proxy    *kfntest.PGProxy
	pool     *pgxpool.Pool
	nats     []*kfntest.NATSServer
	natsURL  string
	kafka    *kafkaUnderTest
	topic    string
	kfn      string // the kfn binary

	mu      sync.Mutex
	seq     int
	workers map[string][]*proc // by function name
	relays  []*proc
	proxied *proc // the orders worker whose Postgres path runs through the proxy
}

// proc is one worker or relay process.
type proc struct {
	id       string
	function string // orders, ledger or relay
	*kfntest.Process
}

func newStack(t *testing.T) *stack {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s := &stack{t: t, workers: map[string][]*proc{}}

	pg, err := devstack.StartPostgres(ctx, devstack.PostgresOptions{})
	if err != nil {
		t.Fatalf("start Postgres: %v", err)
	}
	t.Cleanup(func() { _ = pg.Stop() })
	s.pg, s.dbURL = pg, pg.URL
	cfg, err := pgxpool.ParseConfig(pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	if s.pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.pool.Close)
	if _, err := schema.Migrate(ctx, s.pool); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if *outboxMode == string(outbox.ModeWAL) {
		if _, err := outbox.SetUpWAL(ctx, s.pool); err != nil {
			t.Fatalf("set up the WAL outbox: %v", err)
		}
	}
	u, err := url.Parse(pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	s.proxy = kfntest.PostgresProxy(t, u.Host)
	u.Host = s.proxy.Addr()
	s.proxyURL = u.String()

	s.nats = kfntest.NATSClusterProcesses(t, 3)
	s.natsURL = kfntest.JoinURLs(s.nats)
	s.kafka = startKafka(t)
	s.topic = s.kafka.createTopic(t, partitions)

	// Build every binary before anything is timed.
	s.kfn = kfntest.BuildBinary(t, kfnPkg)
	kfntest.BuildBinary(t, ordersPkg)
	kfntest.BuildBinary(t, ledgerPkg)
	return s
}

// env is the settings every kfn process of the run shares.
func (s *stack) env(id, dbURL string) []string {
	return append(os.Environ(),
		"DATABASE_URL="+dbURL,
		"KFN_KAFKA_BROKERS="+strings.Join(s.kafka.brokers, ","),
		"KFN_NATS_URL="+s.natsURL,
		"KFN_NATS_REPLICAS=3",
		"KFN_WORKER_ID="+id,
		"KFN_LEASE_TTL="+leaseTTL.String(),
		"KFN_LEASE_RENEW="+leaseRenew.String(),
		"KFN_LOG_LEVEL=info",
		"KFN_OUTBOX="+*outboxMode,
	)
}

func (s *stack) nextID(name string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	return name + "-" + strconv.Itoa(s.seq)
}

// ordersKeyLanes is the orders workers' KeyConcurrency.
const ordersKeyLanes = 4

// startWorker starts a worker process of function (orders or ledger); the
// relay runs in processes of its own, so the workers run none.
func (s *stack) startWorker(function string) *proc {
	s.t.Helper()
	return s.startWorkerVia(function, s.dbURL)
}

func (s *stack) startWorkerVia(function, dbURL string) *proc {
	s.t.Helper()
	id := s.nextID(function)
	pkg := ordersPkg
	if function == ledger.Name {
		pkg = ledgerPkg
	}
	cmd := exec.Command(kfntest.BuildBinary(s.t, pkg))
	cmd.Env = append(s.env(id, dbURL), "KFN_NO_RELAY=true", "ORDERS_TOPIC="+s.topic, "KFN_LANES="+strconv.Itoa(ledgerLanes))
	if function != ledger.Name {
		// The orders workers run each partition as key-lanes, which kfn
		// verify checks after every fault like the rest.
		cmd.Env = append(cmd.Env, "KFN_KEY_CONCURRENCY="+strconv.Itoa(ordersKeyLanes))
	}
	p := &proc{id: id, function: function, Process: kfntest.StartProcess(s.t, cmd)}
	s.mu.Lock()
	s.workers[function] = append(s.workers[function], p)
	s.mu.Unlock()
	return p
}

// startRelay starts a kfn relay process for both functions' subjects.
func (s *stack) startRelay() *proc {
	s.t.Helper()
	id := s.nextID("relay")
	cmd := exec.Command(s.kfn, "relay", "--subjects", orders.AcceptedSubject+","+ledger.CapturedSubject)
	cmd.Env = s.env(id, s.dbURL)
	p := &proc{id: id, function: "relay", Process: kfntest.StartProcess(s.t, cmd)}
	s.mu.Lock()
	s.relays = append(s.relays, p)
	s.mu.Unlock()
	return p
}

// startAll starts the deployment: perStage workers of each function (the
// first orders worker through the proxy) and the relays, and waits until
// every worker has started.
func (s *stack) startAll() {
	s.t.Helper()
	// The first worker of each function runs its Setup (the tables) and
	// creates kfn's NATS state before the others race for it.
	s.proxied = s.startWorkerVia(ordersFn, s.proxyURL)
	s.waitStarted(s.proxied)
	s.waitStarted(s.startWorker(ledger.Name))
	for range perStage - 1 {
		s.startWorker(ordersFn)
		s.startWorker(ledger.Name)
	}
	for range relays {
		s.startRelay()
	}
	for _, ws := range s.workers {
		for _, w := range ws {
			s.waitStarted(w)
		}
	}
}

// waitStarted waits until a worker has logged that it started.
func (s *stack) waitStarted(w *proc) {
	s.t.Helper()
	waitUntil(s.t, 60*time.Second, "worker "+w.id+" to start", func() (bool, string) {
		s.requireRunning(w)
		data, err := os.ReadFile(w.LogFile)
		return err == nil && strings.Contains(string(data), `"msg":"worker started"`), "no \"worker started\" log line yet"
	})
}

// requireRunning fails the test if a process that should run has exited.
func (s *stack) requireRunning(ps ...*proc) {
	s.t.Helper()
	for _, p := range ps {
		select {
		case <-p.Exited():
			s.t.Fatalf("%s exited (%v); output:\n%s", p.id, p.ExitErr(), p.LogTail(40))
		default:
		}
	}
}

// running is every worker and relay that should be running now.
func (s *stack) running() []*proc {
	s.mu.Lock()
	defer s.mu.Unlock()
	all := slices.Clone(s.relays)
	for _, ws := range s.workers {
		all = append(all, ws...)
	}
	return all
}

// forget drops a process the run killed or stopped on purpose.
func (s *stack) forget(p *proc) {
	s.mu.Lock()
	defer s.mu.Unlock()
	del := func(ps []*proc) []*proc { return slices.DeleteFunc(ps, func(q *proc) bool { return q == p }) }
	s.workers[p.function] = del(s.workers[p.function])
	s.relays = del(s.relays)
}

// waitUntil polls cond until it holds (kfntest.Await) and stops the test
// if it does not within limit.
func waitUntil(t *testing.T, limit time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	if !kfntest.Await(t, limit, what, cond) {
		t.FailNow()
	}
}

func (s *stack) String() string {
	return fmt.Sprintf("Postgres %s, NATS %s, Kafka %s", s.pg.DataDir, s.natsURL, strings.Join(s.kafka.brokers, ","))
}
