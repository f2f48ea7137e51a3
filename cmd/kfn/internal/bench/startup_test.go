package bench

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

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

// A function binary's start reaches its first commit without waiting out
// any of its intervals: with --batch-wait 2m and --lease-renew 20s (TTL
// 60s), each start's first commit comes within 10 s, half the smallest of
// them, so neither a batch's fill wait nor a lease tick lies on the path.
// The phases keep the fencing order: the lane's claim in Postgres (the
// fence) begins once its lease is held, and its first transaction once the
// fence is raised.
func TestStartupWaitsForNoInterval(t *testing.T) {
	const bound = 10 * time.Second
	cfg := startupSetup(t, 2, 5, "KFN_BATCH_WAIT=2m", "KFN_LEASE_RENEW=20s", "KFN_LEASE_TTL=60s")
	cfg.Starts, cfg.Timeout = 2, bound
	res, err := Startup(t.Context(), cfg)
	if err != nil {
		t.Fatal(err) // a start that waited an interval ends here: no first commit within the bound
	}
	for i, s := range res.Starts {
		at := map[string]StartupPhase{}
		for _, p := range s.Phases {
			at[p.Name] = p
		}
		for _, name := range []string{"exec", "postgres", "kafka", "nats", "lease", "fence", "fetch", "commit"} {
			if _, ok := at[name]; !ok {
				t.Errorf("start %d: no phase %s among %v", i, name, s.Phases)
			}
		}
		if at["fence"].From < at["lease"].To || at["commit"].From < at["fence"].To || at["commit"].From < at["fetch"].To {
			t.Errorf("start %d: the phases are out of order (lease, then fence, then the first batch's commit): %v", i, s.Phases)
		}
		if s.FirstCommit > bound/2 {
			t.Errorf("start %d: first commit %s after the exec: an interval of 20 s or more lies on the path", i, s.FirstCommit)
		}
	}
	t.Logf("\n%s", res)
}
