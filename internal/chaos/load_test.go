//go:build chaos

package chaos_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/functions/orders"
)

// The continuous load: perTick orders every tick, spread over the
// partitions, with acks from every in-sync replica.
const (
	perTick = 20
	tick    = 100 * time.Millisecond
)

// producer writes orders to the topic until stopped. Order i has the id
// orderID(i) and goes to partition i % partitions; a write that fails is
// not retried (it may have landed: kfn verify counts what Kafka holds) and
// its orders are not counted as acked.
type producer struct {
	t      *testing.T
	writer *kafka.Writer

	mu      sync.Mutex
	next    int    // orders attempted
	acked   []bool // by order number
	nAcked  int
	failed  int // writes that failed
	poison  int // poison records written
	lastErr error
	pending int // poison records to write with the next tick
}

func orderID(i int) string { return fmt.Sprintf("chaos-%08d", i) }

func newProducer(t *testing.T, brokers []string, topic string) *producer {
	w := &kafka.Writer{
		Addr:         kafka.TCP(brokers...),
		Topic:        topic,
		Balancer:     kafka.BalancerFunc(func(m kafka.Message, _ ...int) int { return m.Partition }),
		RequiredAcks: kafka.RequireAll,
		BatchSize:    perTick + 1,
		BatchTimeout: time.Millisecond,
		WriteTimeout: 10 * time.Second,
		MaxAttempts:  3,
	}
	t.Cleanup(func() { _ = w.Close() })
	return &producer{t: t, writer: w}
}

// run produces until ctx ends.
func (p *producer) run(ctx context.Context) {
	start := time.Now()
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Until(start.Add(time.Duration(i) * tick))):
		}
		p.tick(ctx)
	}
}

func (p *producer) tick(ctx context.Context) {
	p.mu.Lock()
	first, poison := p.next, p.pending
	p.next += perTick
	p.pending = 0
	p.mu.Unlock()
	msgs := make([]kafka.Message, 0, perTick+poison)
	for j := range perTick {
		i := first + j
		o := orders.Order{ID: orderID(i), Customer: fmt.Sprintf("cust-%02d", i%13), AmountCents: int64(100 + (i*7919)%100000), Currency: "EUR"}
		v, err := json.Marshal(o)
		if err != nil {
			p.t.Error(err)
			return
		}
		msgs = append(msgs, kafka.Message{Partition: i % partitions, Key: []byte(o.ID), Value: v})
	}
	for j := range poison {
		// Not JSON: the orders function rejects it, and kfn dead-letters it.
		msgs = append(msgs, kafka.Message{Partition: j % partitions, Key: []byte("poison"), Value: []byte("{\"order_id\": \x00 not json")})
	}
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	err := p.writer.WriteMessages(wctx, msgs...)
	cancel()
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(p.acked) < first+perTick {
		p.acked = append(p.acked, false)
	}
	if err != nil {
		p.failed++
		p.lastErr = err
		if poison > 0 {
			p.pending += poison // try again with the next tick
		}
		return
	}
	for j := range perTick {
		p.acked[first+j] = true
	}
	p.nAcked += perTick
	p.poison += poison
}

// addPoison asks for a poison record with the next tick.
func (p *producer) addPoison() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.pending++
}

// mark is the number of orders attempted so far and how many of them were
// acked: every order below the mark was written or given up.
func (p *producer) mark() (next, acked int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.next, p.countAcked(p.next)
}

func (p *producer) countAcked(below int) int {
	n := 0
	for i := 0; i < below && i < len(p.acked); i++ {
		if p.acked[i] {
			n++
		}
	}
	return n
}

func (p *producer) stats() (acked, failed, poison int, lastErr error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.nAcked, p.failed, p.poison, p.lastErr
}
