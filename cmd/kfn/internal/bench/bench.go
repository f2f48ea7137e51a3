// Package bench measures what exactly-once costs (kfn bench): it applies
// the same records with the kfn record path, with an at-least-once baseline
// (the same batching without the inbox claim and the fenced cursor), with
// the naive consumer most projects start with, with the relay to JetStream
// (the full pipeline) and through a chain of two functions, against the
// limit of the machine: Postgres ingesting the same rows with COPY, at the
// batch size and connection count that ingest fastest (limit.go), and the
// same with the events emitted to the WAL rather than copied into the
// outbox. It
// reports each mode's throughput, its CPU time per record over every
// process involved (cpu.go), its commit latency (latency.go) and its
// memory (memory.go), and describes the machine (machine.go). It also
// measures the outbox relay alone against a naive relay, and its commit →
// ack latency (relay.go), the relay's share of a worker's CPU
// (relayshare.go), and a function binary's start, from its exec to its
// first commit (startup.go).
package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"slices"
	"sort"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/kafkasource"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

// Modes, in the order they run in each round.
const (
	ModeCopy        = "copy limit"
	ModeWALLimit    = "wal limit"
	ModeExactlyOnce = "exactly-once"
	ModeAtLeastOnce = "at-least-once"
	ModeNaive       = "naive"
	ModePipeline    = "pipeline"
	ModePipelineWAL = "pipeline (wal)"
	ModeChain       = "chain"
)

// Modes returns every mode's name, in the order they run in each round
// (a mode the run's configuration leaves out does not run).
func Modes() []string {
	return []string{ModeCopy, ModeWALLimit, ModeExactlyOnce, ModeAtLeastOnce, ModeNaive, ModePipeline, ModePipelineWAL, ModeChain}
}

// Config describes one benchmark run: Records records already in
// Function's Topic, applied in each mode.
type Config struct {
	Worker       runtime.Config   // connections and batching; shared by every mode
	Function     runtime.Function // the handler under test; its Topic holds the data
	Partitions   int              // partitions of the topic: the copy limit writes with as many connections
	Records      int64            // records in the topic, all applied by the batched modes
	NaiveRecords int64            // how many of them the naive mode applies (it is slow)
	// Next, when set, is a NATS-triggered function consuming what Function
	// emits: the chain mode runs both, until Next has applied every record.
	Next runtime.Function
	// Limit writes the rows of records [first, first+n) for the copy
	// limit, with COPY, inside tx: the business rows, the inbox rows and
	// the outbox rows the exactly-once path writes for them. The copy
	// limit sweeps its batch size and connections (limit.go).
	Limit Writer
	// WALLimit, when set, writes the same records as the WAL outbox mode
	// would: the business and inbox rows with COPY, and each event with
	// pg_logical_emit_message(true, …) instead of an outbox row. The wal
	// limit sweeps it as the copy limit is swept.
	WALLimit Writer
	// WALPipeline, when set, adds the pipeline with the WAL outbox (its
	// events emitted to the WAL and relayed from the database's slot, set
	// up by the caller): the mode ModePipelineWAL.
	WALPipeline bool
	// Reset clears the business tables and the event stream between modes,
	// so every mode does the same writes.
	Reset func(ctx context.Context, tx pgx.Tx) error
	// Rounds runs the modes this many times, interleaved, and reports each
	// mode's median round, so a noisy neighbour skews no mode alone.
	// Default 1.
	Rounds int
	// Processes are those whose CPU time is counted (FindProcesses).
	Processes []Process
	// Progress, when set, gets a line per mode and round as they finish,
	// and every ProgressEvery (default 10s) while a mode runs.
	Progress      io.Writer
	ProgressEvery time.Duration
	// CPUProfile, when set, is where a CPU profile of this process during
	// the first round of CPUProfileMode (default ModeExactlyOnce) is
	// written.
	CPUProfile     string
	CPUProfileMode string

	done *atomic.Int64 // the records the running mode has done so far
}

// Result is one mode's median round (by throughput).
type Result struct {
	Mode      string
	Records   int64
	Elapsed   time.Duration
	PerSecond float64
	CPU       CPU       // CPU time of each process during the median round
	Rounds    []float64 // msgs/s of every round, in order
	RoundsCPU []float64 // CPU-s per 10k records of every round, over every process, in order
	Commit    Latency   // commit latency of the median round
	// PeakRSS is this process's peak resident memory during the median
	// round (0: unknown); PostgresMemory what the Postgres server held at
	// its end (0: unknown, or not on this machine). See memory.go.
	PeakRSS        int64
	PostgresMemory int64
	// For a limit: the setting of its median round's best rate, and every
	// setting that round tried (limit.go).
	Setting LimitSetting
	Sweep   []SweepPoint
}

// CPUPer10k is the CPU time of process name (every process if empty) per
// 10,000 records, in seconds.
func (r Result) CPUPer10k(name string) float64 {
	d := r.CPU.Total()
	if name != "" {
		d = r.CPU[name]
	}
	return d.Seconds() * 10000 / float64(r.Records)
}

// round is one run of one mode.
type round struct {
	records  int64
	elapsed  time.Duration
	cpu      CPU
	commit   Latency
	peakRSS  int64
	postgres int64
	setting  LimitSetting // a limit's best setting
	sweep    []SweepPoint // a limit's every setting
}

type mode struct {
	name string
	run  func(context.Context, *Config, string) (round, error)
}

// Run runs every mode over the same records, round after round, and returns
// each mode's median round.
func Run(ctx context.Context, cfg Config) ([]Result, error) {
	if cfg.Function.Handler == nil && cfg.Function.BatchHandler == nil {
		return nil, errors.New("bench: the function has no handler")
	}
	if cfg.NaiveRecords > cfg.Records || cfg.NaiveRecords < 2 {
		return nil, fmt.Errorf("bench: naive records %d must be in 2..%d", cfg.NaiveRecords, cfg.Records)
	}
	modes := []mode{
		{ModeCopy, benchLimit(func(cfg *Config) Writer { return cfg.Limit })},
		{ModeWALLimit, benchLimit(func(cfg *Config) Writer { return cfg.WALLimit })},
		{ModeExactlyOnce, benchBatched(engine.NewWorker, false)},
		{ModeAtLeastOnce, benchBatched(newAtLeastOnceWorker, false)},
		{ModeNaive, benchNaive},
		{ModePipeline, benchBatched(engine.NewWorker, true)},
		{ModePipelineWAL, benchWALPipeline},
	}
	if cfg.Next.Name != "" {
		modes = append(modes, mode{ModeChain, benchChain})
	}
	modes = slices.DeleteFunc(modes, func(m mode) bool {
		return m.name == ModeCopy && cfg.Limit == nil || m.name == ModeWALLimit && cfg.WALLimit == nil ||
			m.name == ModePipelineWAL && !cfg.WALPipeline
	})
	rounds := make([][]round, len(modes))
	for r := 0; r < max(1, cfg.Rounds); r++ {
		for i, m := range modes {
			consumer := fmt.Sprintf("%s-%s-%d", cfg.Function.Name, shortName(m.name), time.Now().UnixNano())
			stopProfile, err := cfg.profile(r == 0 && m.name == cmp.Or(cfg.CPUProfileMode, ModeExactlyOnce))
			if err != nil {
				return nil, err
			}
			resetPeakRSS()
			cfg.done = new(atomic.Int64)
			stopTicker := cfg.tick(fmt.Sprintf("round %d/%d  %-13s", r+1, max(1, cfg.Rounds), m.name))
			res, err := m.run(ctx, &cfg, consumer)
			stopTicker()
			stopProfile()
			if err != nil {
				return nil, fmt.Errorf("bench %s: %w", m.name, err)
			}
			rounds[i] = append(rounds[i], res)
			if cfg.Progress != nil {
				fmt.Fprintf(cfg.Progress, "round %d/%d  %-13s %7d records  %6.2f s  %8.0f msgs/s  %.2f CPU-s/10k\n", r+1, max(1, cfg.Rounds), m.name,
					res.records, res.elapsed.Seconds(), float64(res.records)/res.elapsed.Seconds(), res.cpu.Total().Seconds()*10000/float64(res.records))
			}
			if err := benchReset(ctx, cfg); err != nil {
				return nil, err
			}
		}
	}
	results := make([]Result, len(modes))
	for i, rs := range rounds {
		rates, cpus := make([]float64, len(rs)), make([]float64, len(rs))
		for j, r := range rs {
			rates[j] = float64(r.records) / r.elapsed.Seconds()
			cpus[j] = r.cpu.Total().Seconds() * 10000 / float64(r.records)
		}
		sorted := append([]round(nil), rs...)
		sort.Slice(sorted, func(a, b int) bool {
			return float64(sorted[a].records)/sorted[a].elapsed.Seconds() < float64(sorted[b].records)/sorted[b].elapsed.Seconds()
		})
		m := sorted[len(sorted)/2]
		results[i] = Result{Mode: modes[i].name, Records: m.records, Elapsed: m.elapsed, PerSecond: float64(m.records) / m.elapsed.Seconds(), CPU: m.cpu, Rounds: rates, RoundsCPU: cpus,
			Commit: m.commit, PeakRSS: m.peakRSS, PostgresMemory: m.postgres, Setting: m.setting, Sweep: m.sweep}
	}
	return results, nil
}

// shortName is a mode's name as a part of a consumer name.
func shortName(mode string) string {
	switch mode {
	case ModeCopy:
		return "copy"
	case ModeWALLimit:
		return "wal"
	case ModeExactlyOnce:
		return "eo"
	case ModeAtLeastOnce:
		return "alo"
	case ModePipelineWAL:
		return "pipeline-wal"
	default:
		return mode
	}
}

// tick prints, every ProgressEvery until the returned function is called,
// how far the running mode has come, after prefix.
func (cfg *Config) tick(prefix string) (stop func()) {
	if cfg.Progress == nil {
		return func() {}
	}
	every := cfg.ProgressEvery
	if every <= 0 {
		every = 10 * time.Second
	}
	done, started := cfg.done, time.Now()
	quit, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-t.C:
				fmt.Fprintf(cfg.Progress, "%s %7d records so far, %.0f s\n", prefix, done.Load(), time.Since(started).Seconds())
			}
		}
	}()
	return func() {
		close(quit)
		<-exited
	}
}

// profile starts the CPU profile when on and cfg asks for one; the
// returned function stops it.
func (cfg *Config) profile(on bool) (func(), error) {
	if !on || cfg.CPUProfile == "" {
		return func() {}, nil
	}
	f, err := os.Create(cfg.CPUProfile)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

func benchReset(ctx context.Context, cfg Config) error {
	pool, err := pgxpool.New(ctx, cfg.Worker.DatabaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	if cfg.WALPipeline {
		if err := skipWAL(ctx, pool); err != nil {
			return fmt.Errorf("reset between benchmark modes: %w", err)
		}
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `TRUNCATE kfn.outbox, kfn.inbox, kfn.event_inbox`); err != nil {
			return fmt.Errorf("reset between benchmark modes: %w", err)
		}

		if cfg.Reset == nil {
			return nil
		}
		return cfg.Reset(ctx, tx)
	})
}

// clock measures a mode from its first commit (start-up, leases and
// connections are not counted) to its end: wall time and CPU time; and its
// commit latency, and memory at its end.
type clock struct {
	procs   []Process
	start   time.Time
	before  CPU
	commits commitTimes // every transaction of the mode, from its start
}

func (c *clock) started() bool { return !c.start.IsZero() }

func (c *clock) begin() {
	c.start, c.before = time.Now(), SampleCPU(c.procs)
}

// end closes the round; the mode's connections are still open, so the
// Postgres backends that served it are counted in its memory.
func (c *clock) end(records int64) round {
	r := round{records: records, elapsed: time.Since(c.start), cpu: SampleCPU(c.procs).Sub(c.before), commit: c.commits.latency(), peakRSS: peakRSS()}
	for _, p := range c.procs {
		if p.Name == "postgres" {
			r.postgres += residentMemory(p.PID)
		}
	}
	return r
}

// benchBatched runs a worker made by newWorker until it has applied every
// record (and, with relay, until its relay has published their events, or
// republished them).
func benchBatched(newWorker func(context.Context, runtime.Config, ...runtime.Function) (*engine.Worker, error), relay bool) func(context.Context, *Config, string) (round, error) {
	return func(ctx context.Context, cfg *Config, consumer string) (round, error) {
		fn := cfg.Function
		fn.Name = consumer
		wcfg := cfg.Worker
		wcfg.NoRelay = !relay
		wk, err := newWorker(ctx, wcfg, fn)
		if err != nil {
			return round{}, err
		}
		done := func() (int64, bool) {
			applied := wk.Stats().Applied.Load()
			if !relay {
				return applied, applied >= cfg.Records
			}
			// An event republished after a relay lost its shard's lease
			// (the machine starved it) is acked as a duplicate.
			rs, _ := wk.RelayStats()
			return applied, applied >= cfg.Records && int64(rs.Published+rs.Duplicates) >= cfg.Records
		}
		return runUntil(ctx, cfg, wk, done)
	}
}

// benchWALPipeline is the pipeline with the WAL outbox: the worker emits
// its events to the WAL, and its relay reads them from the slot.
func benchWALPipeline(ctx context.Context, cfg *Config, consumer string) (round, error) {
	wal := *cfg
	wal.Worker.Outbox = string(outbox.ModeWAL)
	return benchBatched(engine.NewWorker, true)(ctx, &wal, consumer)
}

// skipWAL starts the WAL outbox slot anew at the WAL's end, so that the
// next mode's relay reads none of an earlier mode's events (the stream was
// purged: they would count as its own) and decodes none of their WAL. It
// drops the slot and creates it again, as `kfn migrate --outbox wal` made
// it: moving it with pg_replication_slot_advance moved its confirmed
// position only, and its restart_lsn stayed where the last standby
// snapshot before it was, so the next walsender decoded the earlier
// modes' WAL (240 MB, 2.9 s of the pipeline (wal) round, and 1.2 s of
// its CPU) before the first event of its own, which a relay that reads
// all along never does. The last mode's walsender may still be going
// away; the slot is free within seconds.
func skipWAL(ctx context.Context, pool *pgxpool.Pool) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := restartSlot(ctx, pool)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("start the WAL outbox slot anew past the last mode's events: %w", err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// restartSlot drops the WAL outbox's slot (if it is there) and creates it
// again at the WAL's end.
func restartSlot(ctx context.Context, pool *pgxpool.Pool) error {
	var slot string
	if err := pool.QueryRow(ctx, `SELECT slot_name FROM kfn.wal_outbox`).Scan(&slot); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`, slot); err != nil {
		return err
	}
	var lsn string
	if err := pool.QueryRow(ctx, `SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')`, slot).Scan(&lsn); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `UPDATE kfn.wal_outbox SET created_lsn = $1::pg_lsn`, lsn)
	return err
}

// benchChain runs Function and Next in one worker, with the relay between
// them, until Next has applied every record.
func benchChain(ctx context.Context, cfg *Config, consumer string) (round, error) {
	first, next := cfg.Function, cfg.Next
	first.Name, next.Name = consumer, consumer+"-next"
	wcfg := cfg.Worker
	wcfg.NoRelay = false
	wk, err := engine.NewWorker(ctx, wcfg, first, next)
	if err != nil {
		return round{}, err
	}
	return runUntil(ctx, cfg, wk, func() (int64, bool) {
		applied := wk.Stats().Functions()[next.Name].Applied
		return applied, applied >= cfg.Records
	})
}

// runUntil runs wk until done says so, timing from the first record done.
func runUntil(ctx context.Context, cfg *Config, wk *engine.Worker, done func() (int64, bool)) (round, error) {
	c := clock{procs: cfg.Processes}
	wk.Stats().OnCommit(func(_ string, records int, took time.Duration) { c.commits.add(records, took) })
	runCtx, stop := context.WithCancel(ctx)
	exited := make(chan error, 1)
	go func() { exited <- wk.Run(runCtx) }()
	defer func() {
		stop()
		<-exited
	}()
	var before int64
	for {
		n, finished := done()
		cfg.done.Store(n)
		if !c.started() && n > 0 {
			c.begin()
			before = n
		}
		if finished {
			return c.end(n - before), nil
		}
		select {
		case <-ctx.Done():
			return round{}, ctx.Err()
		case err := <-exited:
			return round{}, fmt.Errorf("the worker stopped: %v", err)
		case <-time.After(time.Millisecond):
		}
	}
}

// benchNaive is the baseline most consumers start with: a consumer group
// reader, and per record one transaction and one synchronous offset commit.
// The clock starts once the first record is through (the group has
// joined): it applies NaiveRecords records and times all but the first.
func benchNaive(ctx context.Context, cfg *Config, consumer string) (round, error) {
	pool, err := pgxpool.New(ctx, cfg.Worker.DatabaseURL)
	if err != nil {
		return round{}, err
	}
	defer pool.Close()
	_, dialer, err := kafkaconn.Kafka(cfg.Worker.KafkaSecurity)
	if err != nil {
		return round{}, err
	}
	reader := kafka.NewReader(kafka.ReaderConfig{
		Brokers: cfg.Worker.KafkaBrokers, Dialer: dialer, GroupID: consumer, Topic: cfg.Function.Topic,
		StartOffset: kafka.FirstOffset, MinBytes: 1, MaxBytes: 16 << 20, MaxWait: 100 * time.Millisecond,
		Logger: kafka.LoggerFunc(func(string, ...any) {}),
	})
	defer reader.Close()
	fn := cfg.Function
	fn.Name = consumer
	c := clock{procs: cfg.Processes}
	for n := int64(0); n < cfg.NaiveRecords; n++ {
		msg, err := reader.FetchMessage(ctx)
		if err != nil {
			return round{}, err
		}
		rec := kafkasource.RecordFromMessage(msg)
		err = c.commits.timed(1, func() error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				rows, err := engine.HandleRecord(ctx, tx, fn, rec)
				if err != nil {
					return err
				}
				return outbox.Insert(ctx, tx, rows)
			})
		})
		if err != nil {
			return round{}, err
		}
		if err := reader.CommitMessages(ctx, msg); err != nil {
			return round{}, err
		}
		cfg.done.Store(n + 1)
		if n == 0 {
			c.begin()
		}
	}
	return c.end(cfg.NaiveRecords - 1), nil
}
