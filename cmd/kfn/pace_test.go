package main

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestPacerKeepsItsRate asks a pacer at its own tick, with jitter, for 10
// simulated seconds, at rates below and above the tick rate: the count is
// the rate × 10 s within one event. The old sample producer sent
// max(1, rate/20) per 50 ms tick, 20 records/s for --rate 5.
func TestPacerKeepsItsRate(t *testing.T) {
	for _, rate := range []float64{1, 5, 13, 200, 5000} {
		start := time.Unix(0, 0)
		p := newPacer(rate, start)
		sent := 0
		now := start
		for i := 0; now.Sub(start) < 10*time.Second; i++ {
			now = now.Add(p.tick() + time.Duration(i%7)*time.Millisecond) // a late ticker
			sent += p.due(now)
		}
		want := rate * now.Sub(start).Seconds()
		if d := float64(sent) - want; d > 1 || d < -1 {
			t.Errorf("rate %v: sent %d in %s, want %.0f", rate, sent, now.Sub(start), want)
		}
	}
}

// TestDevSampleTrafficKeepsItsRate runs kfn dev's producer against Kafka
// for 10 s at 5 and 50 records/s, and counts what landed: within 10%.
func TestDevSampleTrafficKeepsItsRate(t *testing.T) {
	k := kfntest.Kafka(t)
	for _, rate := range []int{5, 50} {
		t.Run(fmt.Sprintf("rate=%d", rate), func(t *testing.T) {
			t.Parallel() // 10 s each
			topic := k.CreateTopic(t, 2)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			gen := &sampleTraffic{}
			err := gen.produce(ctx, k.Brokers, runtime.KafkaSecurity{}, topic, rate)
			cancel()
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("produce: %v", err)
			}
			var landed int64
			for _, hw := range k.HighWatermarks(t, topic) {
				landed += hw
			}
			want := float64(rate * 10)
			t.Logf("--rate %d: %d records in 10 s (%d counted by the producer)", rate, landed, gen.sent.Load())
			if f := float64(landed); f < want*0.9 || f > want*1.1 {
				t.Errorf("--rate %d: %d records landed in 10 s, want %.0f ± 10%%", rate, landed, want)
			}
		})
	}
}
