package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// relayFixture is what a relay test needs: a fresh database, a NATS
// connection, and a stream name and subject of its own.
type relayFixture struct {
	t       testing.TB
	db      *kfntest.PG
	natsURL string
	nc      *nats.Conn
	js      jetstream.JetStream
	stream  string
	subject string // events are published on subject + ".<kind>"
	offset  int64  // source offsets handed out so far
	mode    Mode   // where tryInsert writes: the table (zero value) or the WAL
	mu      sync.Mutex
}

func newRelayFixture(t testing.TB, natsURL string) *relayFixture {
	t.Helper()
	f := &relayFixture{t: t, db: kfntest.Postgres(t), natsURL: natsURL}
	f.nc, f.js = connectJetStream(t, natsURL)
	name := kfntest.Name(t, "t")
	f.stream = strings.ToUpper(name)
	f.subject = name
	return f
}

func connectJetStream(t testing.TB, url string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.RetryOnFailedConnect(true))
	if err != nil {
		t.Fatalf("connect to NATS: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// config returns a relay config for the fixture with fast test timings.
func (f *relayFixture) config() RelayConfig {
	return RelayConfig{
		Pool:         f.db.Pool,
		JetStream:    f.js,
		Stream:       f.stream,
		Subjects:     []string{f.subject + ".>"},
		PollInterval: 200 * time.Millisecond,
		RetryMin:     20 * time.Millisecond,
		RetryMax:     500 * time.Millisecond,
		AckTimeout:   2 * time.Second,
		Logger:       testLogger(),
	}
}

// testLogger logs to stderr at the level in KFN_TEST_LOG (debug, info,
// warn; default error only: outages in fault tests log warnings by design).
func testLogger() *slog.Logger {
	level := slog.LevelError
	switch os.Getenv("KFN_TEST_LOG") {
	case "debug":
		level = slog.LevelDebug
	case "info":
		level = slog.LevelInfo
	case "warn":
		level = slog.LevelWarn
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}

// startRelay runs a relay until the returned stop is called (or the test
// ends) and fails the test if Run returns an error.
func (f *relayFixture) startRelay(cfg RelayConfig) (*Relay, func()) {
	f.t.Helper()
	r, err := NewRelay(cfg)
	if err != nil {
		f.t.Fatalf("new relay: %v", err)
	}
	return r, kfntest.Background(f.t, "relay run", r.Run)
}

// newRows makes perKey events for each key, interleaved (k0#0, k1#0, …,
// k0#1, …), as emitted by consecutive source records.
func (f *relayFixture) newRows(keys []string, perKey int) []Row {
	f.mu.Lock()
	defer f.mu.Unlock()
	var rows []Row
	for i := range perKey {
		for _, key := range keys {
			f.offset++
			origin := Origin{
				Consumer: "fn-test", Topic: "in", Partition: 0, Offset: f.offset,
				SourceID: KafkaSourceID("in", 0, f.offset),
			}
			rows = append(rows, NewRow(origin, 0, key, Event{
				Subject: f.subject + ".evt",
				Key:     key,
				Data:    fmt.Appendf(nil, "%s#%d", key, i),
			}))
		}
	}
	return rows
}

// insert commits rows in one transaction.
func (f *relayFixture) insert(rows []Row) {
	f.t.Helper()
	if err := f.tryInsert(rows); err != nil {
		f.t.Fatal(err)
	}
}

func (f *relayFixture) tryInsert(rows []Row) error {
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error { return Write(ctx, tx, f.mode, rows) })
	if err != nil {
		return fmt.Errorf("insert outbox rows: %w", err)
	}
	return nil
}

func (f *relayFixture) outboxCount() int {
	f.t.Helper()
	var n int
	if err := f.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM kfn.outbox").Scan(&n); err != nil {
		f.t.Fatalf("count outbox: %v", err)
	}
	return n
}

// streamMsgs returns how many messages the stream holds (0 if it does not
// exist yet).
func (f *relayFixture) streamMsgs() int {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, f.stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return 0
	}
	if err != nil {
		f.t.Logf("stream info: %v", err)
		return -1
	}
	return int(s.CachedInfo().State.Msgs)
}

// streamMsg is one stored message as a plain consumer sees it.
type streamMsg struct {
	Seq     uint64
	Subject string
	Header  nats.Header
	Data    []byte
}

// readStream reads every message of the stream with an ordered consumer,
// which removes no duplicates: what it returns is what is stored.
func (f *relayFixture) readStream() []streamMsg {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		f.t.Fatalf("read stream: %v", err)
	}
	total := int(s.CachedInfo().State.Msgs)
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		f.t.Fatalf("ordered consumer: %v", err)
	}
	out := make([]streamMsg, 0, total)
	for len(out) < total {
		batch, err := cons.Fetch(1000, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			f.t.Fatalf("fetch: %v", err)
		}
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				f.t.Fatalf("metadata: %v", err)
			}
			out = append(out, streamMsg{Seq: md.Sequence.Stream, Subject: m.Subject(), Header: m.Headers(), Data: m.Data()})
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
			f.t.Fatalf("fetch: %v", err)
		}
		if ctx.Err() != nil {
			f.t.Fatalf("read only %d of %d stream messages", len(out), total)
		}
	}
	return out
}

// deliverySettle is how long waitDelivered watches the stream after the
// outbox emptied: longer than the fixture's poll interval, so a relay that
// publishes a row again after deleting it (or publishes one twice) shows.
const deliverySettle = 300 * time.Millisecond

// waitDelivered waits until the outbox is empty and the stream holds at
// least n messages, and returns how long that took. Then it lets the relay
// settle and requires exactly n: a message more is a duplicate the
// stream's duplicate window did not catch, or an invention.
func (f *relayFixture) waitDelivered(n int, timeout time.Duration) time.Duration {
	f.t.Helper()
	start := time.Now()
	deadline := start.Add(timeout)
	for {
		rows, msgs := f.outboxCount(), f.streamMsgs()
		if rows == 0 && msgs >= n {
			break
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("after %v: %d rows left in the outbox, %d of %d messages in the stream", timeout, rows, msgs, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	took := time.Since(start)
	time.Sleep(deliverySettle)
	if rows, msgs := f.outboxCount(), f.streamMsgs(); rows != 0 || msgs != n {
		f.t.Fatalf("%v after the outbox emptied: %d rows in the outbox and %d messages in the stream, want 0 and exactly %d", deliverySettle, rows, msgs, n)
	}
	return took
}

// deliveryReport compares what the stream holds with the rows that were
// committed, in commit order.
type deliveryReport struct {
	lost, duplicated, reordered, unexpected int
	problems                                []string
}

func (r *deliveryReport) addProblem(format string, args ...any) {
	if len(r.problems) < 10 {
		r.problems = append(r.problems, fmt.Sprintf(format, args...))
	}
}

func checkDelivery(msgs []streamMsg, committed []Row) deliveryReport {
	var rep deliveryReport
	want := make(map[string]Row, len(committed))
	wantOrder := map[string][]string{} // key → event ids in commit order
	for _, r := range committed {
		want[r.EventID] = r
		wantOrder[r.Event.Key] = append(wantOrder[r.Event.Key], r.EventID)
	}
	seen := map[string]int{}
	gotOrder := map[string][]string{}
	for _, m := range msgs {
		id := m.Header.Get(jetstream.MsgIDHeader)
		r, ok := want[id]
		if !ok {
			rep.unexpected++
			rep.addProblem("unexpected message seq %d id %q", m.Seq, id)
			continue
		}
		seen[id]++
		if seen[id] > 1 {
			rep.duplicated++
			rep.addProblem("duplicate of %s (key %s) at seq %d", id, r.Event.Key, m.Seq)
			continue
		}
		gotOrder[r.Event.Key] = append(gotOrder[r.Event.Key], id)
	}
	for id, r := range want {
		if seen[id] == 0 {
			rep.lost++
			rep.addProblem("lost %s (key %s, data %s)", id, r.Event.Key, r.Event.Data)
		}
	}
	for key, ids := range wantOrder {
		got := gotOrder[key]
		j := 0
		for _, id := range ids {
			if seen[id] == 0 {
				continue // counted as lost
			}
			if j < len(got) && got[j] != id {
				rep.reordered++
				rep.addProblem("key %s: position %d holds %s, want %s", key, j, got[j], id)
				break
			}
			j++
		}
	}
	return rep
}

func (f *relayFixture) requireExactlyOnceInOrder(committed []Row) []streamMsg {
	f.t.Helper()
	msgs := f.readStream()
	rep := checkDelivery(msgs, committed)
	if rep.lost+rep.duplicated+rep.reordered+rep.unexpected != 0 {
		f.t.Fatalf("stream holds %d messages for %d committed events: lost %d, duplicated %d, reordered keys %d, unexpected %d\n%s",
			len(msgs), len(committed), rep.lost, rep.duplicated, rep.reordered, rep.unexpected, strings.Join(rep.problems, "\n"))
	}
	return msgs
}

// requirePublishedOnce requires that relay published n events, each once:
// the stream acked n as new and none as a duplicate. The stream's
// duplicate window drops a second publish of an event without a trace in
// the stream, so a relay that sends events twice passes every check of the
// stream's contents; only its own counters show it.
func requirePublishedOnce(t testing.TB, relay *Relay, n int) {
	t.Helper()
	if st := relay.Stats(); st.Published != uint64(n) || st.Duplicates != 0 {
		t.Errorf("relay published %d events and %d again (acked as duplicates), want %d and none: %+v", st.Published, st.Duplicates, n, st)
	}
}

func keyNames(prefix string, n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s-%d", prefix, i)
	}
	return keys
}
