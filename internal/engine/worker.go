package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/kafkasource"
	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/internal/naming"
	"github.com/kfn-dev/kfn/internal/observe"
	"github.com/kfn-dev/kfn/internal/preflight"
	"github.com/kfn-dev/kfn/internal/repeatlog"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/internal/tracing"
	"github.com/kfn-dev/kfn/outbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// Worker runs functions: it owns partitions, reads them and applies their
// records exactly once.
type Worker struct{ w *worker }

type worker struct {
	cfg kfn.Config
	// partitionTracker, when set, replaces the tracker of each partition lane:
	// the benchmark's at-least-once baseline (atLeastOnceTracker) is the only
	// user.
	partitionTracker func(*partitionTracker) cursorLane
	fns              []kfn.Function
	pool             *pgxpool.Pool
	kafka            *kafkasource.Source
	nc               *nats.Conn
	js               jetstream.JetStream
	leases           map[string]*lease.Manager // partition leases, per function name
	relay            *outbox.Relay             // nil with NoRelay, or when no function emits
	// installation scopes the lease groups (kfn.installation.id).
	installation string
	startedAt    time.Time // when this worker started, by the database's clock
	offsets      *kafkasource.GroupMirror
	stats        *observe.Stats
	tracing      *tracing.Provider // the exporter this worker started, flushed by close; nil with Config.TracerProvider
	tracer       trace.Tracer      // nil while tracing is off
	ready        readiness         // the last probe of the services, for /readyz
	health       *observe.PGHealth // whether this worker reaches Postgres; the lease managers' Healthy hook
	// repeats logs the failures its parts retry (lanes, probes), each kind
	// once per step of its schedule with a count (package repeatlog).
	repeats *repeatlog.Log

	// retries are the running lanes, woken for dead letters marked for
	// retry (retry_lane.go).
	retries *retryLanes
	// readersClosing are the Kafka readers of lanes that have returned.
	readersClosing sync.WaitGroup

	// terminateDenied logs, once, that this worker's role may not end an
	// older owner's session (claimBlocked).
	terminateDenied sync.Once
	// start times the start up to the first commit, which logs it.
	start    *startClock
	runBegan time.Time // when Run was called: the lease phase's start
}

// NewWorker validates cfg and fns, connects to Postgres, Kafka and NATS,
// checks the schema version and runs each function's Setup (unless
// cfg.SkipSetup). Every failure says which setting or service is at fault.
func NewWorker(ctx context.Context, cfg kfn.Config, fns ...kfn.Function) (*Worker, error) {
	start := newStartClock()
	cfg = cfg.WithDefaults()
	if err := preflight.ValidateConfig(cfg, kafkaTopic(fns) != ""); err != nil {
		return nil, err
	}
	if len(fns) == 0 {
		return nil, errors.New("no function to run")
	}
	seen := map[string]bool{}
	var fromKafka []string
	for _, fn := range fns {
		if err := validateFunction(fn); err != nil {
			return nil, err
		}
		if seen[fn.Name] {
			return nil, fmt.Errorf("function %s is given twice", fn.Name)
		}
		seen[fn.Name] = true
		if fn.Topic != "" {
			fromKafka = append(fromKafka, fn.Name)
		}
	}
	if cfg.ConsumerGroup != "" && len(fromKafka) > 1 {
		return nil, preflight.ConfigErrorOf(settings.ConsumerGroup, "%q is set for a worker that runs %d Kafka functions (%s), and each needs a group of its own: leave it unset (each function's name) or run them in separate processes",
			cfg.ConsumerGroup, len(fromKafka), strings.Join(fromKafka, ", "))
	}
	w := &worker{cfg: cfg, fns: fns, stats: &observe.Stats{}, retries: newRetryLanes(), repeats: repeatlog.New(), start: start}
	ok := false
	defer func() {
		if !ok {
			w.close()
		}
	}()
	if _, err := w.registry(); err != nil {
		return nil, err
	}
	service := fns[0].Name
	if len(fns) > 1 {
		service = "kfn-worker"
	}
	if err := w.startTracing(ctx, service); err != nil {
		return nil, err
	}
	start.phase(phaseConfig, start.began)
	if err := w.connect(ctx); err != nil {
		return nil, err
	}
	if !cfg.SkipSetup {
		if err := start.timed(phaseSetup, func() error { return preflight.RunSetup(ctx, w.pool, fns) }); err != nil {
			return nil, preflight.SetupDenied(err)
		}
	}
	ok = true
	return &Worker{w: w}, nil
}

func (w *worker) connect(ctx context.Context) error {
	// Postgres, Kafka and NATS are reached side by side: a start waits for
	// the slowest, not for their sum. The pool of a worker with key-lanes
	// is sized by its partitions (poolSize), so there Kafka goes first.
	kafkaFirst := w.maxKeyConcurrency() > 1
	kafka := func() error { return w.start.timed(phaseKafka, func() error { return w.connectKafka(ctx) }) }
	postgres := func() error {
		if kafkaFirst {
			if err := kafka(); err != nil {
				return err
			}
		}
		return w.start.timed(phasePostgres, func() error { return w.checkPostgres(ctx) })
	}
	var errs [3]error // the first in this order is reported, as when they ran one after the other
	var wg sync.WaitGroup
	wg.Go(func() { errs[0] = postgres() })
	if !kafkaFirst {
		wg.Go(func() { errs[1] = kafka() })
	}
	wg.Go(func() { errs[2] = w.start.timed(phaseNATS, w.connectNATS) })
	wg.Wait()
	if err := cmp.Or(errs[:]...); err != nil {
		return err
	}
	// Then, side by side again, what needs them: the partition leases'
	// bucket and the relay's stream and lease groups.
	w.checkMemory(ctx)
	var then [2]error
	wg.Go(func() { then[0] = w.start.timed(phaseLeaseBucket, func() error { return w.openPartitionLeases(ctx) }) })
	wg.Go(func() { then[1] = w.start.timed(phaseRelay, func() error { return w.setUpRelay(ctx) }) })
	wg.Wait()
	return cmp.Or(then[:]...)
}

// openPartitionLeases opens the partition lease manager of each function.
func (w *worker) openPartitionLeases(ctx context.Context) error {
	w.leases = map[string]*lease.Manager{}
	for _, fn := range w.fns {
		var err error
		if w.leases[fn.Name], err = w.newPartitionLeases(ctx, fn); err != nil {
			return err
		}
	}
	return nil
}

// setUpRelay makes the worker's outbox relay, or with NoRelay has the
// event stream capture what its functions emit.
func (w *worker) setUpRelay(ctx context.Context) error {
	subjects := emittedSubjects(w.fns)
	switch {
	case len(subjects) == 0:
	case w.cfg.NoRelay:
		// Another process relays, but the stream must still capture what
		// these functions emit.
		if _, err := w.extendEventStream(ctx, subjects); err != nil {
			return err
		}
	default:
		var err error
		if w.relay, err = w.newRelay(ctx, subjects); err != nil {
			return err
		}
	}
	return nil
}

// checkPostgres connects to Postgres (connectPostgres) and checks that
// the worker's role may do what its lanes and relay do.
func (w *worker) checkPostgres(ctx context.Context) error {
	if err := w.connectPostgres(ctx); err != nil {
		return err
	}
	relay := !w.cfg.NoRelay && len(emittedSubjects(w.fns)) > 0
	if err := preflight.CheckRole(ctx, w.pool, w.fns, relay); err != nil {
		return err
	}
	if outboxMode(&w.cfg) == outbox.ModeWAL && len(emittedSubjects(w.fns)) > 0 {
		if err := outbox.CheckWAL(ctx, w.pool); err != nil {
			return fmt.Errorf("--%s wal (%s): %w", settings.Outbox.Flag, settings.Outbox.Env, err)
		}
	}
	return nil
}

// connectKafka connects to Kafka when a function reads it, and checks
// that it answers.
func (w *worker) connectKafka(ctx context.Context) error {
	topic := kafkaTopic(w.fns)
	if topic == "" {
		return nil
	}
	var err error
	if w.kafka, err = kafkasource.New(w.cfg.KafkaBrokers, w.cfg.KafkaSecurity, w.cfg.Logger); err != nil {
		return err
	}
	metaCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := w.kafka.Partitions(metaCtx, topic); kafkaconn.IsSecurity(err) {
		return fmt.Errorf("cannot connect to Kafka: %w", err)
	} else if err != nil && !errors.Is(err, kafkasource.ErrTopicMissing) {
		return fmt.Errorf("cannot reach Kafka at %s (check --kafka-brokers / KFN_KAFKA_BROKERS): %w", strings.Join(w.cfg.KafkaBrokers, ","), err)
	}
	w.kafka.FetchBytes, w.kafka.BatchRecords = fetchBytes(w.cfg), w.cfg.BatchSize
	w.offsets = kafkasource.NewGroupMirror(w.kafka, w.cfg.Logger)
	return nil
}

// kafkaTopic returns a topic one of fns consumes, or "" when none reads
// Kafka (NATS-triggered functions only).
func kafkaTopic(fns []kfn.Function) string {
	for _, fn := range fns {
		if fn.Topic != "" {
			return fn.Topic
		}
	}
	return ""
}

// consumerGroup is the Kafka consumer group fn's committed offsets are
// mirrored to: --consumer-group, or the function's name.
func (w *worker) consumerGroup(fn kfn.Function) string {
	if w.cfg.ConsumerGroup != "" {
		return w.cfg.ConsumerGroup
	}
	return fn.Name
}

// connectPostgres opens the pool, checks the schema version and reads the
// installation id.
func (w *worker) connectPostgres(ctx context.Context) error {
	w.health = observe.NewPGHealth(w.cfg)
	size := w.poolSize(ctx)
	var tooSmall error
	var err error
	w.pool, err = connect.Postgres(ctx, w.cfg.DatabaseURL, "kfn-worker "+w.cfg.WorkerID, func(pgCfg *pgxpool.Config) {
		if !strings.Contains(w.cfg.DatabaseURL, "pool_max_conns") {
			pgCfg.MaxConns = size
		} else {
			tooSmall = w.poolTooSmall(pgCfg.MaxConns)
		}
		observe.LimitPostgres(pgCfg, w.cfg, w.health)
	})
	var urlErr *connect.URLError
	if errors.As(err, &urlErr) {
		return preflight.ConfigErrorOf(settings.DatabaseURL, "cannot parse %s: %v", urlErr.URL, urlErr.Err)
	}
	if err != nil {
		return err
	}
	if tooSmall != nil {
		return tooSmall
	}
	if err := schema.Check(ctx, w.pool); err != nil {
		return err
	}
	if v, err := schema.Version(ctx, w.pool); err == nil && v > schema.Latest() {
		w.cfg.Logger.Info("running against a newer schema whose later migrations do not break this binary (a rolling upgrade)",
			"schema", v, "built_for", schema.Latest())
	}
	if w.installation, err = naming.InstallationID(ctx, w.pool); err != nil {
		return err
	}
	// By the database's clock, which all workers share: a change of a lane
	// count is honoured only from workers started after the last one.
	if err := w.pool.QueryRow(ctx, `SELECT now()`).Scan(&w.startedAt); err != nil {
		return fmt.Errorf("read the database's clock: %w", err)
	}
	return nil
}

// connectNATS connects to NATS (reconnecting forever after a loss) and
// opens JetStream.
func (w *worker) connectNATS() error {
	var err error
	w.nc, w.js, err = connect.NATSWith(w.cfg.NATSURL, "kfn "+w.cfg.WorkerID, w.cfg.NATSSecurity)
	return err
}

// startTracing sets the worker's tracer: from cfg.TracerProvider, or else
// from the OTEL_* variables.
func (w *worker) startTracing(ctx context.Context, service string) error {
	tp := w.cfg.TracerProvider
	if tp == nil {
		p, err := tracing.FromEnv(ctx, service, w.cfg.Logger)
		var envErr *tracing.EnvError
		if errors.As(err, &envErr) {
			return &preflight.ConfigError{Env: envErr.Var, Msg: fmt.Sprintf("%q: %s", envErr.Value, envErr.Msg)}
		}
		if err != nil {
			return err
		}
		w.tracing, tp = p, p
	}
	if w.tracing == nil || w.tracing.Enabled() {
		w.tracer = tp.Tracer(tracerName)
	}
	return nil
}

func (w *worker) close() {
	if w.tracing != nil {
		if err := w.tracing.Shutdown(context.Background()); err != nil {
			w.cfg.Logger.Warn("traces not flushed", "err", err)
		}
		w.tracing = nil
	}
	if w.nc != nil {
		w.nc.Close()
	}
	if w.pool != nil {
		w.pool.Close()
	}
}

// Close releases the connections of a worker that will not Run. Run
// releases them itself when it returns.
func (wk *Worker) Close() { wk.w.close() }

// Stats returns the worker's live counters.
func (wk *Worker) Stats() *observe.Stats { return wk.w.stats }

// RelayStats returns the counters of the worker's outbox relay, and false
// when it runs none.
func (wk *Worker) RelayStats() (outbox.RelayStats, bool) {
	if wk.w.relay == nil {
		return outbox.RelayStats{}, false
	}
	return wk.w.relay.Stats(), true
}

// AtLeastOnceBaseline turns this worker, before its Run, into kfn bench's
// at-least-once baseline: its partition lanes claim nothing in the inbox
// and fence nothing, and their cursors move in memory (and to Kafka's
// group offsets) only, with the same batching and transactions, so that
// the benchmark measures what exactly-once costs. It exists for that
// benchmark alone and is never a production mode: runtime/worker, which
// keeps its engine.Worker unexported, offers no way to it.
func (wk *Worker) AtLeastOnceBaseline() { wk.w.partitionTracker = atLeastOnce }

// Run processes records until ctx ends, then finishes in-flight batches,
// releases its partitions, closes its connections and returns.
func (wk *Worker) Run(ctx context.Context) error {
	w := wk.w
	w.runBegan = time.Now()
	defer w.close()
	defer w.readersClosing.Wait()
	defer w.health.Start(ctx)()
	if w.offsets != nil {
		// Stopped after the lanes, so the last commits are mirrored too.
		offsetsCtx, stopOffsets := context.WithCancel(context.WithoutCancel(ctx))
		offsetsDone := make(chan struct{})
		go func() {
			defer close(offsetsDone)
			w.offsets.Run(offsetsCtx, time.Second)
		}()
		defer func() {
			stopOffsets()
			<-offsetsDone
		}()
	}
	readinessDone := make(chan struct{})
	go func() {
		defer close(readinessDone)
		w.watchReadiness(ctx)
	}()
	defer func() { <-readinessDone }()
	purgeDone := make(chan struct{})
	go func() {
		defer close(purgeDone)
		w.purgeInboxes(ctx)
	}()
	defer func() { <-purgeDone }()
	retriesDone := make(chan struct{})
	go func() {
		defer close(retriesDone)
		w.watchRetries(ctx)
	}()
	defer func() { <-retriesDone }()

	errs := make(chan error, len(w.fns)+1)
	for _, fn := range w.fns {
		go func() { errs <- w.own(ctx, fn, w.leases[fn.Name]) }()
	}
	running := len(w.fns)
	if w.relay != nil {
		running++
		go func() {
			// The relay's shard loops (outbox.Shards of them) each read the
			// outbox at once when they start: they would queue the lanes'
			// claims and first commits behind new Postgres connections. So
			// the relay starts after this worker's first commit, or one
			// lease renewal interval (the cadence of every lease's moves)
			// into Run when there is nothing to commit.
			w.start.afterFirstCommit(ctx, w.cfg.LeaseRenew)
			errs <- w.relay.Run(ctx)
		}()
	}
	var first error
	for range running {
		if err := <-errs; err != nil && first == nil && ctx.Err() == nil {
			first = err
		}
	}
	return first
}

// withTx runs f in a transaction.
func (w *worker) withTx(ctx context.Context, f func(ctx context.Context, tx pgx.Tx) error) error {
	return pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error { return f(ctx, tx) })
}
