package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/devstack"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/worker"
)

var devHelp = help{
	usage: []string{"kfn dev [PKG...] [flags]"},
	text: `
Starts a local stack (a throwaway Postgres, an embedded NATS server and
Kafka broker, unless flags point at running ones) and prints export lines
for other terminals. Without packages it runs the bundled orders example
with sample traffic and checks the end state. With packages (directories of
Go main packages calling worker.Start, such as the cmd/NAME of a function
made by kfn new) it builds each, creates its topic (or its stream), runs it
against the stack, shows its counters every second, and rebuilds and
restarts it when a source file of its module changes.

With --databases 2 the demo runs the chain orders → ledger with each
function on a Postgres of its own (a second throwaway cluster for the
ledger), joined only by NATS, and prints the --function-databases export
line with which kfn status, verify, replay and dlq find each function's
database.`,
	examples: `
kfn dev                          # the demo
kfn dev ./payments/cmd/payments  # your function; feed it with kfn produce
kfn dev --duration 20s           # the demo as an end-to-end check
kfn dev --databases 2            # orders → ledger, each on its own Postgres`,
}

func runDev(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("dev", devHelp, stderr)
	services := addServiceFlags(fs)
	duration := fs.Duration("duration", 0, "stop after this long (default: run until Ctrl-C)")
	rate := fs.Int("rate", 200, "sample orders produced per second")
	partitions := fs.Int("partitions", 4, "partitions of the orders topic when it is created")
	verbose := fs.Bool("v", false, "show the workers' logs")
	databases := fs.Int("databases", 1, "1: the demo runs orders; 2: the chain orders → ledger, the ledger on a throwaway Postgres of its own")
	pkgs, err := parsePositional(fs, args, 0, 64, "function packages")
	if err != nil {
		return err
	}
	if *databases < 1 || *databases > 2 {
		return &usageError{msg: fmt.Sprintf("--databases %d: 1 (orders) or 2 (orders and ledger, each on its own Postgres)", *databases)}
	}
	if *databases == 2 && len(pkgs) > 0 {
		return &usageError{msg: "--databases 2 runs the demo chain; your functions take their databases from their own DATABASE_URL"}
	}
	if *rate < 1 || *rate > 100000 {
		return &usageError{msg: fmt.Sprintf("--rate %d is out of range 1..100000", *rate)}
	}
	if *partitions < 1 || *partitions > 256 {
		return &usageError{msg: fmt.Sprintf("--partitions %d is out of range 1..256", *partitions)}
	}
	if *duration < 0 {
		return &usageError{msg: "--duration must not be negative"}
	}
	level := slog.LevelError
	if *verbose {
		level = slog.LevelInfo
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))

	fmt.Fprintln(stdout, "kfn dev: starting the stack")
	st, pool, err := services.start(ctx, stdout, log)
	if err != nil {
		return err
	}
	defer st.stop()
	defer pool.Close()
	var ledgerDB *devDatabase
	if *databases == 2 {
		if ledgerDB, err = startDevDatabase(ctx, stdout, log, ledger.Name); err != nil {
			return err
		}
		defer ledgerDB.stop()
	}
	printExports(stdout, st)
	if ledgerDB != nil {
		fmt.Fprintf(stdout, "export %s=%s\n", settings.FunctionDatabases.Env, shellQuote(ledger.Name+"="+ledgerDB.url))
	}
	if len(pkgs) > 0 {
		runCtx := ctx
		if *duration > 0 {
			var cancel context.CancelFunc
			runCtx, cancel = context.WithTimeout(ctx, *duration)
			defer cancel()
		}
		return runDevFunctions(runCtx, pkgs, st, *partitions, *verbose, stdout, stderr)
	}
	if err := ensureTopic(ctx, st.Brokers, st.Kafka, orders.Topic, *partitions); err != nil {
		return err
	}

	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	if *duration > 0 {
		var cancel context.CancelFunc
		runCtx, cancel = context.WithTimeout(runCtx, *duration)
		defer cancel()
	}
	cfg := runtime.Config{KafkaBrokers: st.Brokers, KafkaSecurity: st.Kafka, DatabaseURL: st.DatabaseURL, NATSURL: st.NATSURL, WorkerID: "kfn-dev", Logger: log}
	// The worker keeps running past runCtx so it can drain what was produced.
	workerCtx, stopWorker := context.WithCancel(context.WithoutCancel(ctx))
	defer stopWorker()
	var chained *worker.Worker // the ledger, with --databases 2
	chainDone := make(chan error, 1)
	if ledgerDB != nil {
		// The ledger first: its worker adds both subjects to the event
		// stream before the orders worker's relay publishes.
		lcfg := cfg
		lcfg.DatabaseURL, lcfg.WorkerID = ledgerDB.url, "kfn-dev-ledger"
		if chained, err = worker.New(ctx, lcfg, ledger.Function()); err != nil {
			return err
		}
		go func() { chainDone <- chained.Run(workerCtx) }()
	}
	worker, err := worker.New(ctx, cfg, orders.Function())
	if err != nil {
		return err
	}
	workerDone := make(chan error, 1)
	go func() { workerDone <- worker.Run(workerCtx) }()

	fmt.Fprintf(stdout, "kfn dev: function orders consumes topic %q; producing %d orders/s (some invalid on purpose). Ctrl-C stops.\n", orders.Topic, *rate)
	if chained != nil {
		fmt.Fprintf(stdout, "kfn dev: function ledger consumes %s, on a database of its own\n", orders.AcceptedSubject)
	}
	gen := &sampleTraffic{}
	produceDone := make(chan error, 1)
	go func() { produceDone <- gen.produce(runCtx, st.Brokers, st.Kafka, orders.Topic, *rate) }()

	ticker := time.NewTicker(time.Second)
	defer ticker.Stop()
	start := time.Now()
	replayAt := time.After(replayDemoAfter(*duration))
	for running := true; running; {
		select {
		case <-runCtx.Done():
			running = false
		case <-ticker.C:
			printProgress(stdout, time.Since(start), gen, worker, chained)
		case <-replayAt:
			if err := replayDemo(ctx, stdout, pool, st.NATSURL); err != nil {
				return err
			}
		}
	}
	if err := <-produceDone; err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("sample producer: %w", err)
	}

	// Ctrl-C ends the traffic, not the check: drain and verify (bounded)
	// even though ctx is cancelled.
	fmt.Fprintln(stdout, "kfn dev: stopping; draining what was produced")
	drainDeadline := time.Now().Add(30 * time.Second)
	for !drained(gen, worker.Stats(), chained) && time.Now().Before(drainDeadline) {
		time.Sleep(100 * time.Millisecond)
	}
	stopWorker()
	if err := <-workerDone; err != nil {
		return err
	}
	if chained != nil {
		if err := <-chainDone; err != nil {
			return err
		}
	}
	printProgress(stdout, time.Since(start), gen, worker, chained)
	verifyCtx, cancelVerify := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancelVerify()
	if err := verifyDev(verifyCtx, stdout, pool, gen); err != nil {
		return err
	}
	if ledgerDB != nil {
		return verifyDevLedger(verifyCtx, stdout, pool, ledgerDB.pool, gen)
	}
	return nil
}

// replayDemoAfter is when kfn dev replays a partition to show that a replay
// skips what was handled: half-way, or after 5 s when running until Ctrl-C.
func replayDemoAfter(duration time.Duration) time.Duration {
	if duration > 0 {
		return duration / 2
	}
	return 5 * time.Second
}

// replayDemo moves partition 0 of the orders function back by up to 100
// records, the way `kfn replay` does. The worker reads them again and skips
// them: "duplicates skipped" grows, the orders table does not change.
func replayDemo(ctx context.Context, out io.Writer, pool *pgxpool.Pool, natsURL string) error {
	cur, err := inbox.ReadCursor(ctx, pool, inbox.Partition{Consumer: "orders", Topic: orders.Topic, Partition: 0})
	if err != nil {
		return fmt.Errorf("replay demo: %w", err)
	}
	from := max(0, cur.NextOffset-100)
	js, closeNATS, err := connectJetStream(natsURL, "kfn dev replay")
	if err != nil {
		return err
	}
	defer closeNATS()
	fmt.Fprintf(out, "kfn dev: replaying orders/%s/0 from offset %d (idempotent, like `kfn replay`): those records are read again and skipped\n", orders.Topic, from)
	_, err = operator.Replay(ctx, pool, js, operator.ReplaySpec{
		Function: "orders", Topic: orders.Topic, Partitions: []int32{0}, From: from,
		ReplayOptions: inbox.ReplayOptions{Actor: "kfn-dev"},
	})
	return err
}

// sampleTraffic produces orders: mostly valid, every 50th malformed, every
// 73rd invalid, so the dead-letter path shows up too.
type sampleTraffic struct {
	valid, invalid, sent atomic.Int64
}

func (g *sampleTraffic) produce(ctx context.Context, brokers []string, sec runtime.KafkaSecurity, topic string, rate int) error {
	// A transport of its own: kafka-go's default one caches metadata across
	// writers, and would not know a topic created after its last refresh.
	transport, _, err := kafkaconn.Kafka(sec)
	if err != nil {
		return err
	}
	defer transport.CloseIdleConnections()
	w := &kafka.Writer{
		Addr: kafka.TCP(brokers...), Topic: topic, Balancer: &kafka.Hash{},
		BatchTimeout: 5 * time.Millisecond, RequiredAcks: kafka.RequireAll, Transport: transport,
	}
	defer w.Close()
	pace := newPacer(float64(rate), time.Now())
	t := time.NewTicker(pace.tick())
	defer t.Stop()
	i := 0
	for {
		var now time.Time
		select {
		case <-ctx.Done():
			return ctx.Err()
		case now = <-t.C:
		}
		n := pace.due(now)
		if n == 0 {
			continue
		}
		msgs := make([]kafka.Message, n)
		var valid, invalid int64
		for j := range msgs {
			i++
			key, value, ok := sampleOrder(i)
			msgs[j] = kafka.Message{Key: []byte(key), Value: value}
			if ok {
				valid++
			} else {
				invalid++
			}
		}
		if err := w.WriteMessages(context.WithoutCancel(ctx), msgs...); err != nil {
			return err
		}
		g.valid.Add(valid)
		g.invalid.Add(invalid)
		g.sent.Add(int64(len(msgs)))
	}
}

// sampleOrder returns the i-th sample record and whether it is a valid order.
func sampleOrder(i int) (key string, value []byte, valid bool) {
	id := fmt.Sprintf("ord-%07d", i)
	switch {
	case i%50 == 0:
		return id, []byte(`{"order_id": "` + id + `", "amount_cents": `), false
	case i%73 == 0:
		v, _ := json.Marshal(orders.Order{ID: id, Customer: "c-1", AmountCents: -5, Currency: "EUR"})
		return id, v, false
	}
	key, value = validOrder(i)
	return key, value, true
}

// validOrder returns the i-th valid sample order.
func validOrder(i int) (key string, value []byte) {
	id := fmt.Sprintf("ord-%07d", i)
	v, _ := json.Marshal(orders.Order{ID: id, Customer: fmt.Sprintf("c-%d", i%17), AmountCents: int64(100 + i%900), Currency: "EUR"})
	return id, v
}

// drained says whether the orders worker has handled every record sent,
// and the ledger (when it runs) booked every valid order.
func drained(g *sampleTraffic, s *worker.Stats, ledger *worker.Worker) bool {
	if ledger != nil && ledger.Stats().Applied.Load() < g.valid.Load() {
		return false
	}
	return s.Applied.Load()+s.DeadLettered.Load() >= g.sent.Load() && s.Lag() == 0
}

// printProgress prints the orders worker's counters, and the ledger's
// bookings when it runs.
func printProgress(w io.Writer, elapsed time.Duration, g *sampleTraffic, wk, ledger *worker.Worker) {
	s := wk.Stats()
	relay, _ := wk.RelayStats()
	chain := ""
	if ledger != nil {
		chain = fmt.Sprintf("  ledger booked %6d", ledger.Stats().Applied.Load())
	}
	fmt.Fprintf(w, "[%5s] produced %6d  processed %6d  duplicates skipped %4d  dead-lettered %4d  retries %3d  lag %5d  relayed %6d  partitions %d%s\n",
		elapsed.Round(time.Second), g.sent.Load(), s.Applied.Load(), s.Duplicates.Load(), s.DeadLettered.Load(),
		s.Retries.Load(), s.Lag(), relay.Published, len(s.Partitions()), chain)
}

// verifyDev checks the end state against what was produced: one order row
// per valid order, each changed by exactly one record, and one dead letter per
// invalid one. Any difference is an error, so `kfn dev --duration …` doubles
// as an end-to-end check.
func verifyDev(ctx context.Context, out io.Writer, pool *pgxpool.Pool, g *sampleTraffic) error {
	var ordersRows, extraRevisions, deadLetters int64
	err := pool.QueryRow(ctx, `SELECT count(*), coalesce(sum(revisions - 1), 0) FROM orders`).Scan(&ordersRows, &extraRevisions)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM kfn.dead_letters WHERE consumer = 'orders'`).Scan(&deadLetters); err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	fmt.Fprintf(out, "kfn dev: verify: valid orders produced %d, order rows %d, duplicate applies %d; invalid produced %d, dead-lettered %d\n",
		g.valid.Load(), ordersRows, extraRevisions, g.invalid.Load(), deadLetters)
	if ordersRows != g.valid.Load() || extraRevisions != 0 || deadLetters != g.invalid.Load() {
		return errors.New("verify: the end state does not match what was produced")
	}
	fmt.Fprintln(out, "kfn dev: verify: OK, every record applied exactly once or dead-lettered")
	return nil
}

// devDatabase is a throwaway Postgres of one function's own, migrated.
type devDatabase struct {
	url  string
	pool *pgxpool.Pool
	stop func()
}

// startDevDatabase starts a throwaway cluster for function and migrates it.
func startDevDatabase(ctx context.Context, out io.Writer, log *slog.Logger, function string) (*devDatabase, error) {
	pg, err := devstack.StartPostgres(ctx, devstack.PostgresOptions{Logger: log})
	if err != nil {
		return nil, fmt.Errorf("a Postgres of its own for %s: %w", function, err)
	}
	pool, err := connectPostgres(ctx, pg.URL)
	if err == nil {
		_, err = schema.Migrate(ctx, pool)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		pg.Stop()
		return nil, fmt.Errorf("a Postgres of its own for %s: %w", function, err)
	}
	fmt.Fprintf(out, "postgres  throwaway cluster of %s's own at %s\n", function, pg.URL)
	return &devDatabase{url: pg.URL, pool: pool, stop: func() { pool.Close(); pg.Stop() }}, nil
}

// verifyDevLedger checks the ledger's end state, in its own database:
// a debit and a credit per valid order, each order booked from one event,
// and no ledger table in the orders function's database.
func verifyDevLedger(ctx context.Context, out io.Writer, ordersDB, ledgerDB *pgxpool.Pool, g *sampleTraffic) error {
	var orderIDs, events, entries int64
	err := ledgerDB.QueryRow(ctx, `SELECT count(DISTINCT order_id), count(DISTINCT event_id), count(*) FROM ledger_entries`).Scan(&orderIDs, &events, &entries)
	if err != nil {
		return fmt.Errorf("verify the ledger: %w", err)
	}
	var misplaced bool
	if err := ordersDB.QueryRow(ctx, `SELECT to_regclass('ledger_entries') IS NOT NULL`).Scan(&misplaced); err != nil {
		return fmt.Errorf("verify the ledger: %w", err)
	}
	fmt.Fprintf(out, "kfn dev: verify: ledger (its own database): valid orders %d, booked %d orders from %d events in %d entries\n", g.valid.Load(), orderIDs, events, entries)
	if orderIDs != g.valid.Load() || events != orderIDs || entries != 2*orderIDs || misplaced {
		return errors.New("verify: the ledger's end state does not match what was produced")
	}
	fmt.Fprintln(out, "kfn dev: verify: OK, the ledger booked every valid order exactly once, on its own database")
	return nil
}
