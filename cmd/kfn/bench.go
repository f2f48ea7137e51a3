package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/cmd/kfn/internal/bench"
	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("bench", stderr)
	fs.describe("usage: kfn bench [flags]\n\nMeasures exactly-once against at-least-once and a naive consumer on the same records, and the relay against a naive relay, on a throwaway stack (or the services the flags name); prints msgs/s and ratios.",
		"kfn bench",
		"kfn bench --batch-size 100 --records 20000 --rounds 5")
	services := addServiceFlags(fs)
	records := fs.Int64("records", 50000, "records applied by the batched modes")
	naive := fs.Int64("naive-records", 3000, "records applied by the naive mode (it is slow)")
	partitions := fs.Int("partitions", 4, "partitions of the benchmark topic")
	var worker runtime.Config // the batched modes' batch settings, the workers' flags
	settings.BatchSize.Bind(fs.settings, &worker.BatchSize)
	settings.BatchWait.Bind(fs.settings, &worker.BatchWait)
	rounds := fs.Int("rounds", 3, "run the modes this many times, interleaved, and report each mode's median")
	relayEvents := fs.Int("relay-events", 0, "outbox backlog relayed by the relay benchmark (default: --records)")
	relayFor := fs.Duration("relay-duration", 5*time.Second, "how long the naive relay and the relay latency run each take")
	relayRate := fs.Int("relay-rate", 2000, "events committed per second in the relay latency run")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *rounds < 1 || *rounds > 20 {
		return &usageError{msg: fmt.Sprintf("--rounds %d is out of range 1..20", *rounds)}
	}
	if *records < 1 || *naive < 1 || *naive > *records {
		return &usageError{msg: fmt.Sprintf("need 1 <= --naive-records (%d) <= --records (%d)", *naive, *records)}
	}
	if *partitions < 1 || *partitions > 256 {
		return &usageError{msg: fmt.Sprintf("--partitions %d is out of range 1..256", *partitions)}
	}
	if !given(fs, "relay-events") {
		*relayEvents = int(min(*records, 1_000_000))
	}
	if *relayEvents < 1 || *relayFor <= 0 || *relayRate < 1 {
		return &usageError{msg: "--relay-events, --relay-duration and --relay-rate must be positive"}
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	st, pool, err := services.start(ctx, stdout, log)
	if err != nil {
		return err
	}
	defer st.stop()
	pool.Close() // the benchmark opens its own connections

	topic := fmt.Sprintf("kfn-bench-%d", time.Now().UnixNano())
	if err := ensureTopic(ctx, st.Brokers, st.Kafka, topic, *partitions); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "producing %d orders to %s (%d partitions)\n", *records, topic, *partitions)
	if err := produceOrders(ctx, st.Brokers, st.Kafka, topic, *records); err != nil {
		return err
	}
	fn := orders.Function()
	fn.Topic = topic
	results, err := bench.Run(ctx, bench.Config{
		Worker: runtime.Config{
			KafkaBrokers: st.Brokers, KafkaSecurity: st.Kafka, DatabaseURL: st.DatabaseURL, NATSURL: st.NATSURL,
			BatchSize: worker.BatchSize, BatchWait: worker.BatchWait, Logger: log,
		},
		Function: fn, Records: *records, NaiveRecords: *naive, Rounds: *rounds,
		Reset: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `TRUNCATE orders`)
			return err
		},
	})
	if err != nil {
		return err
	}
	printBench(stdout, results, worker.BatchSize, worker.BatchWait)

	fmt.Fprintf(stdout, "\nrelay: a backlog of %d outbox events to JetStream; the naive relay for %s; commit→ack latency for %s at %d events/s\n",
		*relayEvents, *relayFor, *relayFor, *relayRate)
	relay, err := benchRelay(ctx, st, outbox.RelayBenchConfig{
		Events: *relayEvents, Rate: *relayRate, Duration: *relayFor, NaiveFor: *relayFor,
		Relay: outbox.RelayConfig{Logger: log},
	})
	if err != nil {
		return err
	}
	printRelayBench(stdout, relay)
	return nil
}

// benchRelay runs outbox.RunRelayBenchmark against the stack's database
// (runtime.Bench leaves its outbox empty, and no worker runs any more) and
// NATS server.
func benchRelay(ctx context.Context, st *stack, cfg outbox.RelayBenchConfig) (outbox.RelayBenchResult, error) {
	pgCfg, err := pgxpool.ParseConfig(st.DatabaseURL)
	if err != nil {
		return outbox.RelayBenchResult{}, &usageError{msg: fmt.Sprintf("--database-url: %v", connect.Scrub(err.Error(), st.DatabaseURL))}
	}
	if pgCfg.ConnConfig.RuntimeParams["application_name"] == "" {
		pgCfg.ConnConfig.RuntimeParams["application_name"] = "kfn bench relay"
	}
	pgCfg.MaxConns = outbox.Shards + 8 // a connection per shard loop, the LISTEN connection and the load
	pool, err := pgxpool.NewWithConfig(ctx, pgCfg)
	if err != nil {
		return outbox.RelayBenchResult{}, fmt.Errorf("relay benchmark: connect to Postgres: %s", connect.Scrub(err.Error(), st.DatabaseURL))
	}
	defer pool.Close()
	js, closeNATS, err := connectJetStream(st.NATSURL, "kfn bench relay")
	if err != nil {
		return outbox.RelayBenchResult{}, err
	}
	defer closeNATS()
	cfg.Pool, cfg.JetStream = pool, js
	return outbox.RunRelayBenchmark(ctx, cfg)
}

func printRelayBench(w io.Writer, r outbox.RelayBenchResult) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "RELAY\tEVENTS\tSECONDS\tEVENTS/S")
	fmt.Fprintf(tw, "relay\t%d\t%.2f\t%.0f\n", r.Events, r.RelayElapsed.Seconds(), r.RelayPerSecond)
	fmt.Fprintf(tw, "naive relay\t%d\t%.2f\t%.0f\n", r.NaiveEvents, r.NaiveElapsed.Seconds(), r.NaivePerSecond)
	tw.Flush()
	fmt.Fprintf(w, "relay / naive relay = %.1f×  (naive: a synchronous publish and a DELETE per event)\n", r.Ratio)
	fmt.Fprintf(w, "commit→ack latency at %.0f events/s (%d events): p50 %s  p99 %s  max %s\n", r.LatencyRateReached, r.LatencyEvents,
		r.LatencyP50.Round(10*time.Microsecond), r.LatencyP99.Round(10*time.Microsecond), r.LatencyMax.Round(10*time.Microsecond))
}

func produceOrders(ctx context.Context, brokers []string, sec kafkaconn.Security, topic string, n int64) error {
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

func printBench(w io.Writer, results []bench.Result, batchSize int, batchWait time.Duration) {
	rate := map[string]float64{}
	for _, r := range results {
		rate[r.Mode] = r.PerSecond
	}
	wait := batchWait.String()
	if batchWait < 0 {
		wait = "0 (no wait)"
	}
	fmt.Fprintf(w, "\nbatch size %d, batch wait %s, handler: orders (upsert + outbox event); median of the rounds\n", batchSize, wait)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MODE\tRECORDS\tSECONDS\tMSGS/S\tROUNDS (MSGS/S)")
	for _, r := range results {
		rounds := make([]string, len(r.Rounds))
		for i, x := range r.Rounds {
			rounds[i] = fmt.Sprintf("%.0f", x)
		}
		fmt.Fprintf(tw, "%s\t%d\t%.2f\t%.0f\t%s\n", r.Mode, r.Records, r.Elapsed.Seconds(), r.PerSecond, strings.Join(rounds, " "))
	}
	tw.Flush()
	eo := rate["exactly-once"]
	fmt.Fprintf(w, "exactly-once / at-least-once = %.2f×\n", eo/rate["at-least-once"])
	fmt.Fprintf(w, "exactly-once / naive         = %.1f×\n", eo/rate["naive"])
}
