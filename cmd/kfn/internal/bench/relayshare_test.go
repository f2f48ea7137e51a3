package bench

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"runtime/pprof"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

// CPUByLabel attributes CPU to the goroutines' labels: the same work done
// under a label and without it comes out near equal.
func TestCPUByLabelSplitsByLabel(t *testing.T) {
	work := func() {
		data := make([]byte, 1<<20)
		for range 150 {
			sum := sha256.Sum256(data)
			data[0] = sum[0]
		}
	}
	cpu, err := CPUByLabel("part", func() error {
		pprof.Do(context.Background(), pprof.Labels("part", "a"), func(context.Context) { work() })
		work()
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	a, none := cpu["a"], cpu[""]
	t.Logf("labelled %v, unlabelled %v", a, none)
	if a < 30*time.Millisecond || none < 30*time.Millisecond {
		t.Fatalf("CPU by label = %v; want at least 30ms under part=a and without the label", cpu)
	}
	if ratio := float64(a) / float64(none); ratio < 0.5 || ratio > 2 {
		t.Errorf("labelled/unlabelled CPU = %.2f for the same work; want near 1", ratio)
	}
}

// BenchmarkRelayShare measures the relay's share of the orders worker's CPU
// at full load: 20,000 orders over 4 partitions, applied and relayed to
// JetStream (NATS as its own process) as fast as they go. It ignores b.N:
//
//	go test -run '^$' -bench BenchmarkRelayShare -benchtime 1x ./cmd/kfn/internal/bench/
func BenchmarkRelayShare(b *testing.B) {
	const records = 20000
	db := kfntest.Postgres(b)
	k := kfntest.Kafka(b)
	nats := kfntest.NATSProcess(b)
	topic := k.CreateTopic(b, 4)
	msgs := make([]kafka.Message, records)
	for i := range msgs {
		o := orders.Order{ID: fmt.Sprintf("ord-%06d", i), Customer: fmt.Sprintf("cust-%03d", i%500), AmountCents: int64(100 + i%9000), Currency: "EUR"}
		v, err := json.Marshal(o)
		if err != nil {
			b.Fatal(err)
		}
		msgs[i] = kafka.Message{Partition: i % 4, Key: []byte(o.ID), Value: v}
	}
	k.Produce(b, topic, msgs...)
	fn := orders.Function()
	fn.Topic = topic
	var res RelayShareResult
	for range b.N {
		var err error
		res, err = RelayShare(context.Background(), Config{
			Worker: runtime.Config{
				KafkaBrokers: k.Brokers, DatabaseURL: db.URL, NATSURL: nats.URL,
				Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
			},
			Function: fn, Records: records,
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(100*res.Share, "relay-%cpu")
	b.ReportMetric(float64(res.Records)/res.Elapsed.Seconds(), "records/s")
	b.Logf("%s", res)
}
