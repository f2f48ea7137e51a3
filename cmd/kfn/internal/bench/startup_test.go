package bench

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// startupSetup gives a Startup config for the orders function's binary,
// built once, on a topic of its own with partitions partitions, against
// the test's Postgres, NATS and Kafka; each start finds perPartition new
// orders waiting on each partition.
func startupSetup(tb testing.TB, partitions, perPartition int, settings ...string) StartupConfig {
	db := kfntest.Postgres(tb)
	k := kfntest.Kafka(tb)
	topic := k.CreateTopic(tb, partitions)
	bin := kfntest.BuildBinary(tb, "github.com/kfn-dev/kfn/functions/orders/cmd/orders")
	return StartupConfig{
		Binary: bin,
		Env: StartupEnv(append([]string{"DATABASE_URL=" + db.URL, "KFN_NATS_URL=" + kfntest.NATSURL(tb),
			"KFN_KAFKA_BROKERS=" + strings.Join(k.Brokers, ","), "ORDERS_TOPIC=" + topic}, settings...)...),
		Produce: func(_ context.Context, round int) error {
			msgs := make([]kafka.Message, 0, partitions*perPartition)
			for p := range partitions {
				for i := range perPartition {
					id := fmt.Sprintf("o-%d-%d-%d", round, p, i)
					msgs = append(msgs, kafka.Message{Partition: p, Key: []byte(id),
						Value: fmt.Appendf(nil, `{"id":%q,"customer":"c","amount_cents":100,"currency":"EUR"}`, id)})
				}
			}
			k.Produce(tb, topic, msgs...)
			return nil
		},
		Settled: func(ctx context.Context) error {
			return AllApplied(ctx, db.Pool, "orders", topic, k.ReadHighWatermarks)
		},
	}
}

// BenchmarkStartup times the orders function's binary from its exec to its
// first commit, with 25 orders waiting on each of 4 partitions: 10 starts
// per run, in 5 rounds of 2; it ignores b.N. With KFN_STARTUP_BASELINE
// naming another build of that binary (an older commit's, say), each round
// also starts it twice, so both are measured on the same services and the
// same load, interleaved:
//
//	go test -run '^$' -bench BenchmarkStartup -benchtime 1x ./cmd/kfn/internal/bench/
func BenchmarkStartup(b *testing.B) {
	cfg := startupSetup(b, 4, 25)
	builds := []string{cfg.Binary}
	if base := os.Getenv("KFN_STARTUP_BASELINE"); base != "" {
		builds = append([]string{base}, builds...)
	}
	for range b.N {
		starts := make([][]Start, len(builds))
		for range 5 {
			for i, bin := range builds {
				c := cfg
				c.Binary, c.Starts = bin, 2
				res, err := Startup(context.Background(), c)
				if err != nil {
					b.Fatal(err)
				}
				starts[i] = append(starts[i], res.Starts...)
			}
		}
		for i, bin := range builds {
			res := Summarize(starts[i])
			b.Logf("%s\n%s", bin, res)
			if bin == cfg.Binary {
				b.ReportMetric(res.P50.Seconds()*1000, "p50-ms")
				b.ReportMetric(res.P90.Seconds()*1000, "p90-ms")
			}
		}
	}
}
