package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	neturl "net/url"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/cmd/kfn/internal/bench"
	"github.com/kfn-dev/kfn/functions/ledger"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/redact"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

func runBench(ctx context.Context, args []string, out, stderr io.Writer) error {
	fs := newFlags("bench", help{
		usage: []string{"kfn bench [flags]"},
		text: `
Measures, on the same records and in interleaved rounds, the Postgres ingest
limit (COPY of the rows exactly-once writes, swept over batch sizes 500 to
5,000 and 1 to 2× --partitions connections: the best is the ceiling), the
same with the events emitted to the WAL (pg_logical_emit_message: the WAL
outbox mode's ceiling), exactly-once, at-least-once, a naive consumer, the
full pipeline (with the relay to JetStream) with the table outbox and, on a
server with wal_level=logical, with the WAL outbox (pipeline (wal)), the
chain orders → ledger, and the relay against a naive relay, on a throwaway stack (or the services
the flags name); prints msgs/s, CPU-seconds per 10k records by process,
ratios, commit latency and memory by mode, the relay's share of the
worker's CPU and, for each outbox mode, its maximum rate of committing
events with the relay running and commit→ack latency at 50% and 80% of
it, with the command and the machine, and writes that report to a file in --report-dir. Progress goes
to stderr.

It writes only into a database of its own (kfn_bench_<random>, created on
the server of --database-url, which needs CREATEDB) and drops it at the
end, also when interrupted, with the WAL outbox's replication slot it made
there (a slot left behind would hold WAL forever); it deletes its topic. It purges the default
event stream between modes: point --nats-url at a NATS server of its own,
never at one that holds events.`,
		examples: `
kfn bench
kfn bench --batch-size 100 --records 20000 --rounds 5
kfn bench --cpuprofile eo.pprof   # then: go tool pprof -top eo.pprof
kfn bench --report-dir ''   # print the report only`,
	}, stderr)
	services := addServiceFlags(fs)
	records := fs.Int64("records", 50000, "records applied by the batched modes")
	naive := fs.Int64("naive-records", 3000, "records applied by the naive mode (it is slow); the first is not timed")
	partitions := fs.Int("partitions", 4, "partitions of the benchmark topic")
	var worker runtime.Config // the batched modes' batch settings, the workers' flags
	settings.BatchSize.Bind(fs.settings, &worker.BatchSize)
	settings.BatchWait.Bind(fs.settings, &worker.BatchWait)
	settings.Outbox.Bind(fs.settings, &worker.Outbox) // the outbox of every mode but pipeline (wal), which has the WAL's
	rounds := fs.Int("rounds", 3, "run the modes this many times, interleaved, and report each mode's median")
	relayEvents := fs.Int("relay-events", 0, "outbox backlog relayed by the relay benchmark (default: --records)")
	relayFor := fs.Duration("relay-duration", 5*time.Second, "how long the naive relay and each relay latency run take")
	relayRate := fs.Int("relay-rate", 0, "events committed per second in the relay latency runs, one per outbox mode (default: 50% and 80% of each mode's maximum rate, measured first)")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of this process (the worker) during the first round of --cpuprofile-mode to this file")
	cpuProfileMode := fs.String("cpuprofile-mode", bench.ModeExactlyOnce, "the mode whose first round --cpuprofile profiles: "+strings.Join(bench.Modes(), ", "))
	progressEvery := fs.Duration("progress-every", 10*time.Second, "while a mode runs, print how far it has come this often (stderr)")
	reportDir := fs.String("report-dir", "testdata/bench", "write the report (what stdout shows) to <start time>-<machine class>.txt in this directory; '' writes none")
	keyLanes := fs.Int("key-lanes", 16, "the key-lanes benchmark: a handler waiting 5 ms per record on one partition, as one lane and as this many key-lanes (KeyConcurrency); 0 skips it")
	keyLanesRecords := fs.Int64("key-lanes-records", 2000, "records applied by each run of the key-lanes benchmark")
	keyLanesOnly := fs.Bool("key-lanes-only", false, "run the key-lanes benchmark only")
	starts := fs.Int("starts", 10, "start → first commit: exec the orders function's binary this many times, with orders waiting, and time each to its first commit (0 skips)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *keyLanes < 0 || *keyLanes > settings.MaxKeyConcurrency || *keyLanes == 1 || (*keyLanesOnly && *keyLanes == 0) || *keyLanesRecords < 2 {
		return &usageError{msg: fmt.Sprintf("--key-lanes %d must be in 2..%d (or 0 to skip the key-lanes benchmark, without --key-lanes-only), and --key-lanes-records at least 2", *keyLanes, settings.MaxKeyConcurrency)}
	}
	if *starts < 0 || *starts > 100 {
		return &usageError{msg: fmt.Sprintf("--starts %d is out of range 0..100", *starts)}
	}
	if *rounds < 1 || *rounds > 20 {
		return &usageError{msg: fmt.Sprintf("--rounds %d is out of range 1..20", *rounds)}
	}
	if *records < 2 || *naive < 2 || *naive > *records {
		return &usageError{msg: fmt.Sprintf("need 2 <= --naive-records (%d) <= --records (%d)", *naive, *records)}
	}
	if *partitions < 1 || *partitions > 256 {
		return &usageError{msg: fmt.Sprintf("--partitions %d is out of range 1..256", *partitions)}
	}
	if !given(fs, "relay-events") {
		*relayEvents = int(min(*records, 1_000_000))
	}
	if *relayEvents < 1 || *relayFor <= 0 {
		return &usageError{msg: "--relay-events and --relay-duration must be positive"}
	}
	if *progressEvery <= 0 {
		return &usageError{msg: fmt.Sprintf("--progress-every %s: must be positive", *progressEvery)}
	}
	if !slices.Contains(bench.Modes(), *cpuProfileMode) {
		return &usageError{msg: fmt.Sprintf("--cpuprofile-mode %q is not a mode: name one of %s", *cpuProfileMode, strings.Join(bench.Modes(), ", "))}
	}
	if *relayRate < 0 {
		return &usageError{msg: fmt.Sprintf("--relay-rate %d: must be positive, or 0 for 50%% and 80%% of the maximum rate", *relayRate)}
	}
	started, machine := time.Now(), bench.DescribeMachine()
	report, err := newBenchReport(*reportDir, started, machine)
	if err != nil {
		return err
	}
	stdout := report.tee(out)
	command, env := benchCommand(fs, args)
	printBenchHeader(stdout, command, env, machine, started)
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	st, err := services.startServices(ctx, stdout, log)
	if err != nil {
		return err
	}
	defer st.stop()
	scratch, err := createScratchDatabase(ctx, st.DatabaseURL, stdout)
	if err != nil {
		return err
	}
	defer func() {
		if err := scratch.drop(); err != nil {
			fmt.Fprintf(stderr, "kfn bench: %v\n", err)
		}
	}()
	st.DatabaseURL = scratch.URL
	fmt.Fprintf(stdout, "database  %s on that server, the benchmark's own: it writes nowhere else, and drops it at the end\n", scratch.Name)
	pool, err := migrated(ctx, st)
	if err != nil {
		return err
	}
	keyLanesBench := func() error {
		if *keyLanes == 0 {
			return nil
		}
		procs := bench.FindProcesses(map[string][]string{"postgres": postgresAddr(st.DatabaseURL), "nats-server": hostPorts(st.NATSURL), "kafka": st.Brokers})
		res, err := benchKeyLanes(ctx, st, stderr, bench.KeyLanesConfig{
			Worker: runtime.Config{
				KafkaBrokers: st.Brokers, KafkaSecurity: st.Kafka, DatabaseURL: st.DatabaseURL, NATSURL: st.NATSURL,
				BatchSize: worker.BatchSize, BatchWait: worker.BatchWait, Logger: log,
			},
			Records: *keyLanesRecords, Lanes: *keyLanes, Wait: 5 * time.Millisecond, Processes: procs, Rounds: *rounds,
		})
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "\n%s", res)
		return nil
	}
	if *keyLanesOnly {
		pool.Close()
		if err := keyLanesBench(); err != nil {
			return err
		}
		return report.write(out)
	}
	// The business tables, before the copy limit writes into them.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := orders.Setup(ctx, tx); err != nil {
			return err
		}
		return ledger.Setup(ctx, tx)
	})
	if err != nil {
		pool.Close()
		return fmt.Errorf("create the orders and ledger tables: %w", err)
	}

	topic := fmt.Sprintf("kfn-bench-%d", time.Now().UnixNano())
	if err := ensureTopic(ctx, st.Brokers, st.Kafka, topic, *partitions); err != nil {
		return err
	}
	defer deleteBenchTopic(st, topic, stderr)
	fmt.Fprintf(stdout, "producing %d orders to %s (%d partitions)\n", *records, topic, *partitions)
	if err := produceOrders(ctx, st.Brokers, st.Kafka, topic, *records); err != nil {
		return err
	}
	js, closeNATS, err := connectJetStream(st.NATSURL, "kfn bench")
	if err != nil {
		pool.Close()
		return err
	}
	defer closeNATS()
	procs := bench.FindProcesses(map[string][]string{"postgres": postgresAddr(st.DatabaseURL), "nats-server": hostPorts(st.NATSURL), "kafka": st.Brokers})
	fmt.Fprintf(stdout, "versions: %s\n", serviceVersions(ctx, pool, js, st, procs))
	walPipeline, err := benchWALOutbox(ctx, pool, stdout, outbox.Mode(worker.Outbox))
	if err != nil {
		pool.Close()
		return err
	}
	pool.Close() // the benchmark opens its own connections
	fmt.Fprintf(stdout, "CPU counted for: %s\n", processList(procs))
	fn := orders.Function()
	fn.Topic = topic
	limitRows := newOrderRows(topic, *partitions)
	cfg := bench.Config{
		Worker: runtime.Config{
			KafkaBrokers: st.Brokers, KafkaSecurity: st.Kafka, DatabaseURL: st.DatabaseURL, NATSURL: st.NATSURL,
			BatchSize: worker.BatchSize, BatchWait: worker.BatchWait, Outbox: worker.Outbox, Logger: log,
		},
		WALPipeline: walPipeline,
		Function:    fn, Next: ledger.Function(), Partitions: *partitions,
		Records: *records, NaiveRecords: *naive, Rounds: *rounds,
		Limit: limitRows.copyOrders, WALLimit: limitRows.emitOrders, Processes: procs, Progress: stderr, ProgressEvery: *progressEvery, CPUProfile: *cpuProfile, CPUProfileMode: *cpuProfileMode,
		Reset: func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `TRUNCATE orders, ledger_entries`); err != nil {
				return err
			}
			// The chain's ledger reads the event stream from its start.
			if s, err := js.Stream(ctx, runtime.DefaultStream); err == nil {
				return s.Purge(ctx)
			}
			return nil
		},
	}
	results, err := bench.Run(ctx, cfg)
	if err != nil {
		return err
	}
	printBench(stdout, results, procs, worker.BatchSize, worker.BatchWait)
	printBenchLatency(stdout, results)

	fmt.Fprintf(stderr, "relay share: the orders worker with its relay over %d records, as fast as it goes, under a CPU profile\n", *records)
	share, err := bench.RelayShare(ctx, cfg)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\n%s  (goal <= 5%%; the relay's goroutines carry the pprof label kfn=relay)\n", share)

	latencyModes := []outbox.Mode{outbox.ModeTable}
	if walPipeline {
		latencyModes = append(latencyModes, outbox.ModeWAL)
	}
	fmt.Fprintf(stdout, "\nrelay: a backlog of %d outbox events to JetStream; the naive relay for %s; commit→ack latency, %s\n",
		*relayEvents, *relayFor, relayLoads(latencyModes, *relayRate, *relayFor))
	fmt.Fprintln(stderr, "relay: the backlog, the naive relay, then the commit→ack latency of each outbox mode")
	relay, err := benchRelay(ctx, st, bench.RelayConfig{
		Events: *relayEvents, Rate: *relayRate, Duration: *relayFor, NaiveFor: *relayFor, Modes: latencyModes,
		Relay: outbox.RelayConfig{Logger: log},
	})
	if err != nil {
		return err
	}
	printRelayBench(stdout, relay)
	if err := keyLanesBench(); err != nil {
		return err
	}
	if err := benchStartup(ctx, st, *starts, *partitions, stdout, stderr); err != nil {
		return err
	}
	return report.write(out)
}

// benchWALOutbox sets up the WAL outbox (its publication and slot) in the
// benchmark's database, for the pipeline (wal) mode, and says whether it
// did: a server without wal_level=logical skips that mode, unless mode
// asks every mode to use it.
func benchWALOutbox(ctx context.Context, pool *pgxpool.Pool, stdout io.Writer, mode outbox.Mode) (bool, error) {
	setup, err := outbox.SetUpWAL(ctx, pool)
	if err != nil {
		if mode == outbox.ModeWAL {
			return false, fmt.Errorf("--%s wal: %w", settings.Outbox.Flag, err)
		}
		fmt.Fprintf(stdout, "pipeline (wal): skipped: %v\n", err)
		return false, nil
	}
	fmt.Fprintf(stdout, "wal outbox: replication slot %s and publication %s in the benchmark's database, dropped with it\n", setup.Slot, setup.Publication)
	return true, nil
}

// benchKeyLanes runs bench.KeyLanes on a topic of one partition holding
// cfg.Records orders (each its own key), deleted at the end.
func benchKeyLanes(ctx context.Context, st *stack, progress io.Writer, cfg bench.KeyLanesConfig) (bench.KeyLanesResult, error) {
	cfg.Topic = fmt.Sprintf("kfn-bench-keylanes-%d", time.Now().UnixNano())
	if err := ensureTopic(ctx, st.Brokers, st.Kafka, cfg.Topic, 1); err != nil {
		return bench.KeyLanesResult{}, err
	}
	defer deleteBenchTopic(st, cfg.Topic, progress)
	if err := produceOrders(ctx, st.Brokers, st.Kafka, cfg.Topic, cfg.Records); err != nil {
		return bench.KeyLanesResult{}, err
	}
	fmt.Fprintf(progress, "key-lanes: %d records on one partition, as one lane, then as %d key-lanes\n", cfg.Records, cfg.Lanes)
	return bench.KeyLanes(ctx, cfg)
}

// deleteBenchTopic deletes the benchmark's topic, on a context of its own
// (the run's may be cancelled).
func deleteBenchTopic(st *stack, topic string, stderr io.Writer) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client, closeClient, err := kafkaClient(st.Brokers, st.Kafka)
	if err == nil {
		defer closeClient()
		var resp *kafka.DeleteTopicsResponse
		if resp, err = client.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: []string{topic}}); err == nil {
			err = resp.Errors[topic]
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "kfn bench: delete its topic %s: %v\n", topic, err)
	}
}

// postgresAddr is the host:port of a database URL, for finding its server
// process; nothing for a URL that does not parse or a Unix socket.
func postgresAddr(url string) []string {
	cfg, err := pgconn.ParseConfig(url)
	if err != nil || strings.HasPrefix(cfg.Host, "/") {
		return nil
	}
	return []string{net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))}
}

// hostPorts lists the host:port of each server of a NATS URL list.
func hostPorts(urls string) []string {
	var out []string
	for _, u := range strings.Split(urls, ",") {
		if parsed, err := neturl.Parse(strings.TrimSpace(u)); err == nil && parsed.Port() != "" {
			out = append(out, parsed.Host)
		}
	}
	return out
}

func processList(procs []bench.Process) string {
	names := make([]string, len(procs))
	for i, p := range procs {
		names[i] = p.String()
	}
	return strings.Join(names, ", ") + " (a service not listed runs inside kfn bench, or on another machine)"
}

// benchRelay runs bench.RunRelay against the stack's database
// (runtime.Bench leaves its outbox empty, and no worker runs any more) and
// NATS server.
func benchRelay(ctx context.Context, st *stack, cfg bench.RelayConfig) (bench.RelayResult, error) {
	pgCfg, err := pgxpool.ParseConfig(st.DatabaseURL)
	if err != nil {
		return bench.RelayResult{}, &usageError{msg: fmt.Sprintf("--database-url: %v", redact.Scrub(err.Error(), st.DatabaseURL))}
	}
	if pgCfg.ConnConfig.RuntimeParams["application_name"] == "" {
		pgCfg.ConnConfig.RuntimeParams["application_name"] = "kfn bench relay"
	}
	pgCfg.MaxConns = outbox.Shards + 8 // a connection per shard loop, the LISTEN connection and the load
	pool, err := pgxpool.NewWithConfig(ctx, pgCfg)
	if err != nil {
		return bench.RelayResult{}, fmt.Errorf("relay benchmark: connect to Postgres: %s", redact.Scrub(err.Error(), st.DatabaseURL))
	}
	defer pool.Close()
	js, closeNATS, err := connectJetStream(st.NATSURL, "kfn bench relay")
	if err != nil {
		return bench.RelayResult{}, err
	}
	defer closeNATS()
	cfg.Pool, cfg.JetStream = pool, js
	return bench.RunRelay(ctx, cfg)
}

// relayLoads says what the latency runs are, for the report.
func relayLoads(modes []outbox.Mode, rate int, d time.Duration) string {
	names := make([]string, len(modes))
	for i, m := range modes {
		names[i] = string(m)
	}
	outboxes := "the " + strings.Join(names, " and the ") + " outbox"
	if rate > 0 {
		return fmt.Sprintf("%s, for %s at %d events/s", outboxes, d, rate)
	}
	shares := make([]string, len(bench.LatencyLoads))
	for i, l := range bench.LatencyLoads {
		shares[i] = fmt.Sprintf("%.0f%%", 100*l)
	}
	return fmt.Sprintf("%s, each for %s at %s of its maximum rate (sessions committing events as fast as they can with the relay running, measured first, for as long)",
		outboxes, d, strings.Join(shares, " and "))
}

func printRelayBench(w io.Writer, r bench.RelayResult) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "RELAY\tEVENTS\tSECONDS\tEVENTS/S")
	fmt.Fprintf(tw, "relay\t%d\t%.2f\t%.0f\n", r.Events, r.RelayElapsed.Seconds(), r.RelayPerSecond)
	fmt.Fprintf(tw, "naive relay\t%d\t%.2f\t%.0f\n", r.NaiveEvents, r.NaiveElapsed.Seconds(), r.NaivePerSecond)
	tw.Flush()
	fmt.Fprintf(w, "relay / naive relay = %.1f×  (naive: a synchronous publish and a DELETE per event)\n", r.Ratio)
	fmt.Fprintf(w, "relay cost on the backlog, in this process: %s\n", r.RelayCost)
	fmt.Fprintln(w, "commit→ack latency by outbox mode: P50, P99, MAX from sending COMMIT to the stream's ack, over events;"+
		" COMMIT: the COMMIT's own round trip (its WAL flush), over transactions; REPLY: from the COMMIT's reply to the ack;"+
		" MAX-RATE: events/s committed and acked with sessions committing as fast as they can; ASKED/S and REACHED/S: a paced run's rate (reached: events over the time to the last ack)")
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "OUTBOX\tMAX-RATE\tLOAD\tASKED/S\tREACHED/S\tEVENTS\tP50\tP99\tMAX\tCOMMIT-P50\tCOMMIT-P99\tREPLY-P50\tREPLY-P99")
	ms := func(d time.Duration) time.Duration { return d.Round(10 * time.Microsecond) }
	for _, m := range r.Latency {
		maxRate := "-"
		if m.MaxRate > 0 {
			maxRate = fmt.Sprintf("%.0f", m.MaxRate)
		}
		for _, l := range m.Loads {
			load := "asked"
			if l.Share > 0 {
				load = fmt.Sprintf("%.0f%%", 100*l.Share)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%.0f\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", m.Mode, maxRate, load, l.Rate, l.Reached, l.Events,
				ms(l.P50), ms(l.P99), ms(l.Max), ms(l.CommitP50), ms(l.CommitP99), ms(l.ReplyP50), ms(l.ReplyP99))
		}
	}
	tw.Flush()
}

func produceOrders(ctx context.Context, brokers []string, sec runtime.KafkaSecurity, topic string, n int64) error {
	transport, _, err := kafkaconn.Kafka(sec)
	if err != nil {
		return err
	}
	defer transport.CloseIdleConnections()
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, Balancer: &kafka.Hash{},
		BatchSize: 1000, BatchTimeout: 10 * time.Millisecond, RequiredAcks: kafka.RequireAll, Transport: transport}
	defer w.Close()
	const chunk = 5000
	for i := int64(0); i < n; i += chunk {
		msgs := make([]kafka.Message, 0, chunk)
		for j := i; j < min(n, i+chunk); j++ {
			key, value := validOrder(int(j))
			msgs = append(msgs, kafka.Message{Key: []byte(key), Value: value})
		}
		if err := w.WriteMessages(ctx, msgs...); err != nil {
			return fmt.Errorf("produce benchmark orders: %w", err)
		}
	}
	return nil
}

func printBench(w io.Writer, results []bench.Result, procs []bench.Process, batchSize int, batchWait time.Duration) {
	byMode := map[string]bench.Result{}
	for _, r := range results {
		byMode[r.Mode] = r
	}
	wait := batchWait.String()
	if batchWait < 0 {
		wait = "0 (no wait)"
	}
	fmt.Fprintf(w, "\nbatch size %d, batch wait %s, handler: orders (batch upsert + outbox event); median of the rounds; CPU-s/10k: CPU seconds per 10,000 records\n", batchSize, wait)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	header := "MODE\tRECORDS\tSECONDS\tMSGS/S\tCPU-S/10K"
	for _, p := range procs {
		header += "\t" + strings.ToUpper(strings.ReplaceAll(p.Name, " ", "-"))
	}
	fmt.Fprintln(tw, header+"\tROUNDS (MSGS/S)")
	for _, r := range results {
		rounds := make([]string, len(r.Rounds))
		for i, x := range r.Rounds {
			rounds[i] = fmt.Sprintf("%.0f", x)
		}
		line := fmt.Sprintf("%s\t%d\t%.2f\t%.0f\t%.2f", r.Mode, r.Records, r.Elapsed.Seconds(), r.PerSecond, r.CPUPer10k(""))
		for _, p := range procs {
			line += fmt.Sprintf("\t%.2f", r.CPUPer10k(p.Name))
		}
		fmt.Fprintln(tw, line+"\t"+strings.Join(rounds, " "))
	}
	tw.Flush()
	eo, alo, naive, limit := byMode[bench.ModeExactlyOnce], byMode[bench.ModeAtLeastOnce], byMode[bench.ModeNaive], byMode[bench.ModeCopy]
	for _, l := range []bench.Result{limit, byMode[bench.ModeWALLimit]} {
		if len(l.Sweep) == 0 {
			continue
		}
		points := make([]string, len(l.Sweep))
		for i, p := range l.Sweep {
			points[i] = fmt.Sprintf("%d×%d %.0f", p.Batch, p.Connections, p.PerSecond)
		}
		fmt.Fprintf(w, "%s: best of the sweep, %s (its median round's msgs/s by batch×connections: %s)\n", l.Mode, l.Setting, strings.Join(points, ", "))
	}
	fmt.Fprintln(w, "ratios: of the medians, the median of each round's ratio (the modes of a round run back to back), and the median of each round's ratio of CPU per record (b's CPU-s/10k over a's, all processes)")
	fmt.Fprintf(w, "exactly-once / copy limit    = %s  (the swept ceiling, reached with %s)\n", ratios(eo, limit), limit.Setting)
	fmt.Fprintf(w, "exactly-once / at-least-once = %s  (goal >= 0.90, with the compact inbox key)\n", ratios(eo, alo))
	if wal, ok := byMode[bench.ModeWALLimit]; ok {
		fmt.Fprintf(w, "wal limit / copy limit       = %s  (the WAL outbox mode's ceiling: events emitted with pg_logical_emit_message, reached with %s)\n", ratios(wal, limit), wal.Setting)
	}
	fmt.Fprintf(w, "exactly-once / naive         = %.1f×\n", eo.PerSecond/naive.PerSecond)
	if p, ok := byMode[bench.ModePipeline]; ok {
		fmt.Fprintf(w, "pipeline / exactly-once      = %s; pipeline CPU = %.2f CPU-s/10k over all processes (the table outbox)\n", ratios(p, eo), p.CPUPer10k(""))
	}
	if p, ok := byMode[bench.ModePipelineWAL]; ok {
		fmt.Fprintf(w, "pipeline (wal) / exactly-once = %s; pipeline (wal) CPU = %.2f CPU-s/10k over all processes (goals >= 0.85 and <= 0.6)\n", ratios(p, eo), p.CPUPer10k(""))
	}
}

// ratios prints a's throughput over b's: of their medians, then the median
// of the rounds' ratios with each round's, then the same by CPU per record
// (b's CPU-s per 10k records over a's, round by round): the throughput
// ratio a machine whose cores all processes share would reach once they
// are saturated, and less sensitive than the rates to other work on a
// shared machine.
func ratios(a, b bench.Result) string {
	var each, byCPU []float64
	for i := range min(len(a.Rounds), len(b.Rounds)) {
		each = append(each, a.Rounds[i]/b.Rounds[i])
	}
	for i := range min(len(a.RoundsCPU), len(b.RoundsCPU)) {
		if a.RoundsCPU[i] > 0 && b.RoundsCPU[i] > 0 {
			byCPU = append(byCPU, b.RoundsCPU[i]/a.RoundsCPU[i])
		}
	}
	if len(each) == 0 {
		return fmt.Sprintf("%.2f", a.PerSecond/b.PerSecond)
	}
	out := fmt.Sprintf("%.2f; by round %s", a.PerSecond/b.PerSecond, medianOf(each))
	if len(byCPU) > 0 {
		out += "; by CPU per record " + medianOf(byCPU)
	}
	return out
}

// medianOf prints the median of xs, then each x in order in brackets.
func medianOf(xs []float64) string {
	shown := make([]string, len(xs))
	for i, x := range xs {
		shown[i] = fmt.Sprintf("%.2f", x)
	}
	sorted := slices.Clone(xs)
	slices.Sort(sorted)
	return fmt.Sprintf("%.2f (%s)", sorted[len(sorted)/2], strings.Join(shown, " "))
}
