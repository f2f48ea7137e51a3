package systemtest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

// The chain tests run real worker processes with short leases, so that a
// killed worker's partitions, relay shards and subject lane move quickly.
const (
	leaseTTL   = 2 * time.Second
	leaseRenew = 500 * time.Millisecond

	ordersPkg = "github.com/kfn-dev/kfn/functions/orders/cmd/orders"
	ledgerPkg = "github.com/kfn-dev/kfn/functions/ledger/cmd/ledger"
)

// chain is the whole production topology of one test: the orders topic of
// its own, a nats-server process of its own, the functions' databases (one
// shared by both, unless the test gives the ledger its own), and the
// worker processes it started.
type chain struct {
	t          *testing.T
	pg         *kfntest.PG // the orders function's database
	ledgerPG   *kfntest.PG // the ledger's: pg, or a database of its own
	kafka      *kfntest.KafkaCluster
	nats       *kfntest.NATSServer
	topic      string
	partitions int
	seq        int
}

func newChain(t *testing.T, partitions int) *chain {
	t.Helper()
	pg := kfntest.Postgres(t)
	return newChainOn(t, partitions, pg, pg)
}

// newChainOn is newChain with the orders function on database ordersPG and
// the ledger on ledgerPG.
func newChainOn(t *testing.T, partitions int, ordersPG, ledgerPG *kfntest.PG) *chain {
	t.Helper()
	c := &chain{t: t, pg: ordersPG, ledgerPG: ledgerPG, kafka: kfntest.Kafka(t), nats: kfntest.NATSProcess(t), partitions: partitions}
	c.topic = c.kafka.CreateTopic(t, partitions)
	// Build both binaries before anything is timed.
	kfntest.BuildBinary(t, ordersPkg)
	kfntest.BuildBinary(t, ledgerPkg)
	return c
}

// worker is one function process.
type worker struct {
	id string
	*kfntest.Process
}

// start starts a worker process of pkg with a fresh worker id; extra holds
// KEY=value settings.
func (c *chain) start(pkg, name string, extra ...string) *worker {
	c.t.Helper()
	c.seq++
	id := name + "-" + strconv.Itoa(c.seq)
	db := c.pg
	if pkg == ledgerPkg {
		db = c.ledgerPG
	}
	cmd := exec.Command(kfntest.BuildBinary(c.t, pkg))
	cmd.Env = append(os.Environ(),
		"DATABASE_URL="+db.URL,
		"KFN_KAFKA_BROKERS="+strings.Join(c.kafka.Brokers, ","),
		"KFN_NATS_URL="+c.nats.URL,
		"KFN_WORKER_ID="+id,
		"KFN_LEASE_TTL="+leaseTTL.String(),
		"KFN_LEASE_RENEW="+leaseRenew.String(),
		"KFN_NO_RELAY=false",
		"KFN_LOG_LEVEL=info",
		"ORDERS_TOPIC="+c.topic,
	)
	cmd.Env = append(cmd.Env, extra...)
	return &worker{id: id, Process: kfntest.StartProcess(c.t, cmd)}
}

func (c *chain) startOrders(extra ...string) *worker { return c.start(ordersPkg, "orders", extra...) }
func (c *chain) startLedger(extra ...string) *worker { return c.start(ledgerPkg, "ledger", extra...) }

// waitStarted waits until the worker has logged that it started: it is
// connected, its function's Setup ran and its lanes are being claimed.
func (w *worker) waitStarted(t *testing.T) {
	t.Helper()
	waitUntil(t, 30*time.Second, "worker "+w.id+" to start", func() (bool, string) {
		select {
		case <-w.Exited():
			t.Fatalf("worker %s exited (%v); output:\n%s", w.id, w.ExitErr(), w.LogTail(40))
		default:
		}
		data, err := os.ReadFile(w.LogFile)
		return err == nil && strings.Contains(string(data), `"msg":"worker started"`), "no \"worker started\" log line yet"
	})
}

// requireAlive fails the test if a worker has exited.
func requireAlive(t *testing.T, ws ...*worker) {
	t.Helper()
	for _, w := range ws {
		select {
		case <-w.Exited():
			t.Fatalf("worker %s exited (%v); output:\n%s", w.id, w.ExitErr(), w.LogTail(40))
		default:
		}
	}
}

// stopClean stops the workers with SIGTERM, all at once, and requires each
// to exit with status 0.
func stopClean(t *testing.T, ws ...*worker) {
	t.Helper()
	var wg sync.WaitGroup
	for _, w := range ws {
		wg.Go(w.Stop)
	}
	wg.Wait()
	for _, w := range ws {
		if err := w.ExitErr(); err != nil {
			t.Errorf("worker %s exited with %v on SIGTERM; output:\n%s", w.id, err, w.LogTail(40))
		}
	}
}

// order returns the i-th order of a test: 13 customers, two currencies.
func order(i int) orders.Order {
	currency := "EUR"
	if i%5 == 0 {
		currency = "USD"
	}
	return orders.Order{
		ID:          fmt.Sprintf("ord-%06d", i),
		Customer:    fmt.Sprintf("cust-%02d", i%13),
		AmountCents: int64(100 + (i*7919)%100000),
		Currency:    currency,
	}
}

// produce writes orders to the chain's topic, order i to partition
// i % partitions, keyed by the order id.
func (c *chain) produce(batch []orders.Order, first int) {
	c.t.Helper()
	msgs := make([]kafka.Message, len(batch))
	for j, o := range batch {
		v, err := json.Marshal(o)
		if err != nil {
			c.t.Fatal(err)
		}
		msgs[j] = kafka.Message{Partition: (first + j) % c.partitions, Key: []byte(o.ID), Value: v}
	}
	c.kafka.Produce(c.t, c.topic, msgs...)
}

// requireEntriesAtMost fails the test at once when the ledger holds more
// entries than want: an event was booked twice, and waiting cannot fix it.
func (c *chain) requireEntriesAtMost(got, want int64) {
	c.t.Helper()
	if got > want {
		c.t.Fatalf("the ledger holds %d entries, more than the %d its events account for: an event was booked twice", got, want)
	}
}

// count runs a count query in the orders function's database.
func (c *chain) count(query string, args ...any) int64 {
	c.t.Helper()
	return c.countIn(c.pg, query, args...)
}

// countIn runs a count query in database pg.
func (c *chain) countIn(pg *kfntest.PG, query string, args ...any) int64 {
	c.t.Helper()
	var n int64
	if err := pg.Pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		c.t.Fatalf("%s: %v", query, err)
	}
	return n
}

// tableCount counts a table's rows, and 0 while it does not exist yet
// (a function creates its table when its first worker starts): the
// ledger's table in the ledger's database, any other in the orders
// function's.
func (c *chain) tableCount(table string) int64 {
	c.t.Helper()
	pg := c.pg
	if table == "ledger_entries" {
		pg = c.ledgerPG
	}
	var exists bool
	if err := pg.Pool.QueryRow(context.Background(), `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil {
		c.t.Fatalf("look up table %s: %v", table, err)
	}
	if !exists {
		return 0
	}
	return c.countIn(pg, `SELECT count(*) FROM `+table)
}

// jetStream connects to the chain's NATS server; the connection closes
// when the test ends.
func (c *chain) jetStream() jetstream.JetStream {
	c.t.Helper()
	nc, err := nats.Connect(c.nats.URL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(nc.Close)
	return jetStreamOf(c.t, nc)
}

func jetStreamOf(t *testing.T, nc *nats.Conn) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// streamIDs reads every message on subject in the event stream and counts
// them per Nats-Msg-Id, with the message bodies by id.
func streamIDs(t *testing.T, js jetstream.JetStream, subject string) (map[string]int, map[string][]byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := js.Stream(ctx, runtime.DefaultStream)
	if err != nil {
		t.Fatalf("stream %s: %v", runtime.DefaultStream, err)
	}
	info, err := stream.Info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		t.Fatalf("stream %s info: %v", runtime.DefaultStream, err)
	}
	want := int(info.State.Subjects[subject])
	counts, bodies := map[string]int{}, map[string][]byte{}
	if want == 0 {
		return counts, bodies
	}
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject}})
	if err != nil {
		t.Fatalf("ordered consumer on %s: %v", subject, err)
	}
	for read := 0; read < want; {
		batch, err := cons.Fetch(min(500, want-read), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatalf("read %s: %v", subject, err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			id := m.Headers().Get(jetstream.MsgIDHeader)
			counts[id]++
			bodies[id] = m.Data()
		}
		if err := batch.Error(); err != nil {
			t.Fatalf("read %s: %v", subject, err)
		}
		if n == 0 {
			t.Fatalf("read %s: %d of %d messages, then nothing", subject, read, want)
		}
		read += n
	}
	return counts, bodies
}

// consumerIdle reports whether the ledger's durable consumer has nothing
// pending and nothing awaiting an ack.
func consumerIdle(js jetstream.JetStream) (bool, string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cons, err := js.Consumer(ctx, runtime.DefaultStream, "ledger")
	if err != nil {
		return false, fmt.Sprintf("ledger consumer: %v", err)
	}
	ci, err := cons.Info(ctx)
	if err != nil {
		return false, fmt.Sprintf("ledger consumer info: %v", err)
	}
	state := fmt.Sprintf("ledger consumer: %d pending, %d awaiting ack, %d redelivered, %d waiting pulls", ci.NumPending, ci.NumAckPending, ci.NumRedelivered, ci.NumWaiting)
	return ci.NumPending == 0 && ci.NumAckPending == 0, state
}

// waitUntil polls cond until it holds (kfntest.Await) and stops the test
// if it does not within limit.
func waitUntil(t *testing.T, limit time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	if !kfntest.Await(t, limit, what, cond) {
		t.FailNow()
	}
}

// waitStreamCovers waits until the event stream exists and captures subject.
func waitStreamCovers(t *testing.T, js jetstream.JetStream, subject string) {
	t.Helper()
	waitUntil(t, 30*time.Second, "the event stream to capture "+subject, func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		stream, err := js.Stream(ctx, runtime.DefaultStream)
		if err != nil {
			return false, err.Error()
		}
		subjects := stream.CachedInfo().Config.Subjects
		return outbox.CoversSubject(subjects, subject), fmt.Sprintf("stream subjects %v", subjects)
	})
}
