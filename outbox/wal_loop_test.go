package outbox

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"

	"github.com/kfn-dev/kfn/internal/repeatlog"
)

// newLoopSession is a WAL session with no Postgres and no NATS behind it:
// its publishes go nowhere, and the caller posts their acks.
func newLoopSession(tb testing.TB, published func(*nats.Msg)) *walSession {
	tb.Helper()
	cfg := RelayConfig{Stream: "EVENTS", Subjects: []string{"orders.>"}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}.WithDefaults()
	cfg.publish = func(_ *nats.Conn, m *nats.Msg) error {
		if published != nil {
			published(m)
		}
		return nil
	}
	r := &Relay{cfg: cfg, log: cfg.Logger, repeats: repeatlog.New(), streamSubjects: cfg.Subjects}
	acks := &ackRouter{publish: cfg.publish, prefix: "_INBOX.bench."}
	for i := range acks.inbox {
		acks.inbox[i].ready = make(chan struct{}, 1)
	}
	return newWALSession(r, nil, "kfn_outbox_bench", 1, acks)
}

// orderItems is n transactions of perTxn events, each with a key of its
// own (as the orders function emits them), as the reader hands them over.
func orderItems(tb testing.TB, n, perTxn int) [][]walItem {
	tb.Helper()
	txns := make([][]walItem, n)
	lsn := pglogrepl.LSN(1 << 20)
	now := time.Now()
	for t := range txns {
		for i := range perTxn {
			id := fmt.Sprintf("order-%d-%d", t, i)
			row := NewRow(Origin{Consumer: "orders", Topic: "orders", Partition: int32(t % 4), Offset: int64(t*perTxn + i), SourceID: id},
				0, id, Event{Subject: "orders.accepted", Data: []byte(`{"id":"` + id + `","amount_cents":1234}`)})
			decoded, err := decodeWALEvent(encodeWALEvent(nil, row, now))
			if err != nil {
				tb.Fatal(err)
			}
			lsn += 200
			txns[t] = append(txns[t], walItem{kind: walEvent, row: decoded, lsn: lsn})
		}
		lsn += 100
		txns[t] = append(txns[t], walItem{kind: walCommit, lsn: lsn})
	}
	return txns
}

// ackOldest posts the acks of up to n of the oldest publishes in flight
// and lets the session take them.
func (s *walSession) ackOldest(ctx context.Context, n int) {
	for _, seq := range s.sent {
		if n == 0 {
			break
		}
		if _, ok := s.flights[seq]; ok {
			s.inbox.post(ackResult{seq: seq})
			n--
		}
	}
	s.takeAcks(ctx)
}

// The session loop on its own, with no Postgres and no NATS: one unacked
// publish per key, a position confirmed only past transactions whose
// events are all acked, and the oldest pending event's emit time, looked
// up at once when events become pending and at most oldestEvery later
// after the oldest is acked.
func TestWALSessionKeepsKeyOrderAndConfirmsOnlyAckedTransactions(t *testing.T) {
	var sent []string
	s := newLoopSession(t, func(m *nats.Msg) { sent = append(sent, m.Header.Get(nats.MsgIdHdr)) })
	ctx := context.Background()
	t0 := time.Now().Add(-time.Minute).Truncate(time.Microsecond)
	t1 := t0.Add(time.Second)
	event := func(id, key string, at time.Time, lsn pglogrepl.LSN) walItem {
		return walItem{kind: walEvent, lsn: lsn, row: relayRow{EventID: id, Subject: "orders.accepted", Type: "orders.accepted", Key: key, CreatedAt: at}}
	}
	items := []walItem{
		event("a1", "k1", t0, 100), event("a2", "k2", t0, 110), {kind: walCommit, lsn: 150},
		event("b1", "k1", t1, 200), event("b2", "k3", t1, 210), {kind: walCommit, lsn: 250},
	}
	for _, it := range items {
		s.take(ctx, it)
	}
	s.advance()
	if fmt.Sprint(sent) != "[a1 a2 b2]" {
		t.Fatalf("published %v; want [a1 a2 b2]: b1 waits for a1, the event of its key before it", sent)
	}
	if got := s.r.counters.walOldest.Load(); got != t0.UnixNano() {
		t.Errorf("oldest pending %v; want %v, set as the events became pending", time.Unix(0, got), t0)
	}
	ack := func(id string) {
		t.Helper()
		for seq, p := range s.flights {
			if p.row.EventID == id {
				s.inbox.post(ackResult{seq: seq})
				s.takeAcks(ctx)
				s.advance()
				return
			}
		}
		t.Fatalf("%s is not in flight", id)
	}
	ack("a1")
	if fmt.Sprint(sent) != "[a1 a2 b2 b1]" {
		t.Fatalf("published %v after a1's ack; want b1 next", sent)
	}
	ack("b2")
	if got := pglogrepl.LSN(s.confirmed.Load()); got != 0 {
		t.Errorf("confirmed %s with a2 unacked; want nothing confirmed", got)
	}
	ack("a2")
	if got := pglogrepl.LSN(s.confirmed.Load()); got != 150 {
		t.Errorf("confirmed %s with the first transaction acked and b1 not; want 0/96 (150), its end", got)
	}
	s.oldestAt = s.oldestAt.Add(-oldestEvery) // oldestEvery has passed
	s.advance()
	if got := s.r.counters.walOldest.Load(); got != t1.UnixNano() {
		t.Errorf("oldest pending %v after the first transaction's acks; want %v", time.Unix(0, got), t1)
	}
	ack("b1")
	if got := pglogrepl.LSN(s.confirmed.Load()); got != 250 {
		t.Errorf("confirmed %s with every event acked; want 0/FA (250)", got)
	}
	if got := s.r.counters.walOldest.Load(); got != 0 || s.pending != 0 || len(s.keys) != 0 {
		t.Errorf("with every event acked: oldest %d, pending %d, keys %d; want 0, 0, 0", got, s.pending, len(s.keys))
	}
}
