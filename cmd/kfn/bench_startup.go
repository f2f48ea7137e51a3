package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/cmd/kfn/internal/bench"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/kafkasource"
	"github.com/kfn-dev/kfn/internal/redact"
)

// startupRecords is how many orders wait on each partition at each start.
const startupRecords = 25

// benchStartup times the orders function's binary from its exec to its
// first commit (bench.Startup), starts times (none for 0), against the stack, on a topic of its own,
// and prints the line and the phases. The binary is built from this
// checkout first (go build, not timed); where it cannot be built (kfn bench
// run outside a kfn checkout), or the brokers need TLS or SASL (which the
// binary would need as flags of its own), it says why it skips.
func benchStartup(ctx context.Context, st *stack, starts, partitions int, stdout, stderr io.Writer) error {
	if starts == 0 {
		return nil
	}
	skip := func(why string) error {
		fmt.Fprintf(stdout, "\nstart → first commit: skipped: %s\n", why)
		return nil
	}
	if kafkaconn.Enabled(st.Kafka) {
		return skip("the brokers need TLS or SASL, which the measured binary is not given")
	}
	dir, err := os.MkdirTemp("", "kfn-bench-startup-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "orders")
	build := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/kfn-dev/kfn/functions/orders/cmd/orders")
	if out, err := build.CombinedOutput(); err != nil {
		return skip(fmt.Sprintf("cannot build the orders function's binary here (run kfn bench in a kfn checkout): %v: %s", err, strings.TrimSpace(string(out))))
	}
	topic := fmt.Sprintf("kfn-bench-startup-%d", time.Now().UnixNano())
	if err := ensureTopic(ctx, st.Brokers, st.Kafka, topic, partitions); err != nil {
		return err
	}
	defer deleteBenchTopic(st, topic, stderr)
	pool, err := pgxpool.New(ctx, st.DatabaseURL)
	if err != nil {
		return fmt.Errorf("start-up benchmark: connect to Postgres: %s", redact.Scrub(err.Error(), st.DatabaseURL))
	}
	defer pool.Close()
	highs := func(ctx context.Context, topic string) (map[int]int64, error) {
		hw := map[int]int64{}
		for p := range partitions {
			_, high, err := kafkasource.OffsetRange(ctx, st.Brokers, st.Kafka, topic, int32(p))
			if err != nil {
				return nil, err
			}
			hw[p] = high
		}
		return hw, nil
	}
	fmt.Fprintf(stderr, "start → first commit: the orders binary started %d times, %d orders waiting on each of %d partitions\n", starts, startupRecords, partitions)
	res, err := bench.Startup(ctx, bench.StartupConfig{
		Binary: bin,
		Env: bench.StartupEnv("DATABASE_URL="+st.DatabaseURL, "KFN_NATS_URL="+st.NATSURL,
			"KFN_KAFKA_BROKERS="+strings.Join(st.Brokers, ","), "ORDERS_TOPIC="+topic),
		Starts: starts,
		Produce: func(ctx context.Context, _ int) error {
			return produceOrders(ctx, st.Brokers, st.Kafka, topic, int64(startupRecords*partitions))
		},
		Settled: func(ctx context.Context) error { return bench.AllApplied(ctx, pool, "orders", topic, highs) },
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\n%s", res)
	return nil
}
