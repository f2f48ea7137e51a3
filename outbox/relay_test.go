package outbox

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestRelayDeliversCommittedRowsOnceWithHeaders(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))

	// Three transactions, one with a traceparent and a custom header.
	rows := f.newRows(keyNames("k", 20), 10)
	const traceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	for i := range rows[:50] {
		rows[i].Origin.TraceParent = traceParent
		rows[i].Event.Headers = map[string]string{"x-tenant": "acme"}
	}
	rows[7].Event.Type = "orders.accepted.v1"
	f.insert(rows[:50])
	f.insert(rows[50:120])
	f.insert(rows[120:])

	relay, _ := f.startRelay(f.config())
	f.waitDelivered(len(rows), 30*time.Second)
	msgs := f.requireExactlyOnceInOrder(rows)
	requirePublishedOnce(t, relay, len(rows))

	byID := map[string]Row{}
	for _, r := range rows {
		byID[r.EventID] = r
	}
	for _, m := range msgs {
		id := m.Header.Get(jetstream.MsgIDHeader)
		r := byID[id]
		want := map[string]string{
			HeaderSpecVersion:     "1.0",
			HeaderID:              r.EventID,
			HeaderType:            r.Event.Type,
			HeaderSource:          "kfn/fn-test",
			HeaderSubject:         r.Event.Key,
			HeaderKey:             r.Event.Key,
			HeaderSourceTopic:     "in",
			HeaderSourcePartition: "0",
			HeaderSourceOffset:    strconv.FormatInt(r.Origin.Offset, 10),
		}
		if r.Origin.TraceParent != "" {
			want["traceparent"] = traceParent
			want["x-tenant"] = "acme"
		}
		for name, v := range want {
			if got := m.Header.Get(name); got != v {
				t.Fatalf("message %s: header %s = %q, want %q (headers %v)", id, name, got, v, m.Header)
			}
		}
		ceTime, err := time.Parse(time.RFC3339Nano, m.Header.Get(HeaderTime))
		if err != nil {
			t.Fatalf("message %s: ce-time %q is not RFC 3339: %v", id, m.Header.Get(HeaderTime), err)
		}
		if age := time.Since(ceTime); age < -time.Minute || age > 5*time.Minute {
			t.Fatalf("message %s: ce-time %s is not when the row was written (%s ago)", id, ceTime, age)
		}
		if m.Subject != r.Event.Subject || string(m.Data) != string(r.Event.Data) {
			t.Fatalf("message %s: subject %q data %q, want %q %q", id, m.Subject, m.Data, r.Event.Subject, r.Event.Data)
		}
	}
	if got := relay.Stats(); got.Published != uint64(len(rows)) || got.Duplicates != 0 || got.LastPublishedAt.IsZero() {
		t.Fatalf("stats = %+v, want %d published, no duplicates", got, len(rows))
	}
	// The stream the relay created has the configured duplicate window.
	s, err := f.js.Stream(context.Background(), f.stream)
	if err != nil {
		t.Fatal(err)
	}
	if d := s.CachedInfo().Config.Duplicates; d != 2*time.Minute {
		t.Fatalf("stream duplicate window = %v, want 2m", d)
	}
}

func TestRelayNeverPublishesRolledBackRows(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	relay, _ := f.startRelay(f.config())
	ctx := context.Background()

	rolledBack := f.newRows(keyNames("rb", 5), 4)
	tx, err := f.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := Insert(ctx, tx, rolledBack); err != nil {
		t.Fatal(err)
	}
	// Let the relay poll and get notified of other commits while the rows
	// exist, uncommitted.
	committed := f.newRows(keyNames("ok", 5), 4)
	f.insert(committed[:10])
	time.Sleep(300 * time.Millisecond)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	f.insert(committed[10:])

	f.waitDelivered(len(committed), 20*time.Second)
	time.Sleep(500 * time.Millisecond) // more than two poll intervals
	f.requireExactlyOnceInOrder(committed)
	requirePublishedOnce(t, relay, len(committed))
}

// A transaction that took a lower id commits after one with a higher id that
// the relay has already published: a cursor-based relay would skip it.
// Meanwhile an unrelated transaction with an xid stays open the whole time:
// a relay bounded by the snapshot's xmin would stall on it.
func TestRelayOutOfOrderCommitsAreNotLost(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	ctx := context.Background()

	longTx, err := f.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer longTx.Rollback(ctx) //nolint:errcheck
	if _, err := longTx.Exec(ctx, "SELECT pg_current_xact_id()"); err != nil {
		t.Fatal(err)
	}

	relay, _ := f.startRelay(f.config())

	// Same shard for A and B, different keys.
	keyA, keyB := sameShardKeys(2)[0], sameShardKeys(2)[1]
	rowsA := f.newRows([]string{keyA}, 3)
	rowsB := f.newRows([]string{keyB}, 3)

	txA, err := f.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer txA.Rollback(ctx) //nolint:errcheck
	if err := Insert(ctx, txA, rowsA); err != nil {
		t.Fatal(err)
	}
	f.insert(rowsB) // tx B: higher ids, commits first

	f.waitDelivered(len(rowsB), 10*time.Second)
	if got := f.readStream(); len(got) != len(rowsB) {
		t.Fatalf("stream holds %d messages before A commits, want %d", len(got), len(rowsB))
	}
	if err := txA.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	f.waitDelivered(len(rowsA)+len(rowsB), 10*time.Second)
	f.requireExactlyOnceInOrder(append(append([]Row{}, rowsA...), rowsB...))
	requirePublishedOnce(t, relay, len(rowsA)+len(rowsB))
}

// sameShardKeys returns n keys that all map to shard 0.
func sameShardKeys(n int) []string {
	var keys []string
	for i := 0; len(keys) < n; i++ {
		k := fmt.Sprintf("s0-%d", i)
		if ShardOf(k) == 0 {
			keys = append(keys, k)
		}
	}
	return keys
}

func TestRelayKeepsPerKeyOrderWhileRowsArrive(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	cfg := f.config()
	cfg.BatchSize = 64 // many batches, each cutting through keys
	cfg.MaxInFlight = 8
	relay, _ := f.startRelay(cfg)

	keys := append(keyNames("k", 40), sameShardKeys(10)...) // a crowded shard too
	var all []Row
	for range 20 {
		rows := f.newRows(keys, 3)
		f.insert(rows)
		all = append(all, rows...)
	}
	f.waitDelivered(len(all), 30*time.Second)
	f.requireExactlyOnceInOrder(all)
	requirePublishedOnce(t, relay, len(all))
}

// flakyPublish fails chosen publishes: fail(n, event id) says whether the
// n-th publish reaches the stream (send) and whether its ack is lost
// (fail). A lost ack is replaced by a 503 "no responders" status on the
// publish's reply subject, the answer the relay gets when no stream
// listens, which it treats as an outage.
func flakyPublish(fail func(n int, eventID string) (send bool, fail bool)) func(*nats.Conn, *nats.Msg) error {
	var n atomic.Int64
	return func(nc *nats.Conn, m *nats.Msg) error {
		send, lose := fail(int(n.Add(1)), m.Header.Get(jetstream.MsgIDHeader))
		if !lose {
			return nc.PublishMsg(m)
		}
		reply := m.Reply
		if send {
			lost := *m
			lost.Reply = nc.NewRespInbox() // nobody listens: the stream's ack goes nowhere
			if err := nc.PublishMsg(&lost); err != nil {
				return err
			}
		}
		return nc.PublishMsg(&nats.Msg{Subject: reply, Header: nats.Header{"Status": []string{"503"}}})
	}
}

// Publishes fail in the middle of the in-flight window, some after the
// message reached the stream, some before. Later events of the failed keys
// must not overtake, and the ones that did reach the stream must not be
// stored twice.
func TestRelayKeepsKeyOrderWhenPublishesFailMidWindow(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	cfg := f.config()
	var mu sync.Mutex
	storedUnacked := map[string]bool{} // events the stream stored whose ack was lost
	cfg.publish = flakyPublish(func(n int, id string) (bool, bool) {
		switch {
		case n%7 == 3:
			return false, true // lost before reaching the server
		case n%11 == 5:
			mu.Lock()
			storedUnacked[id] = true
			mu.Unlock()
			return true, true // stored, but the ack was lost
		}
		return false, false
	})
	keys := sameShardKeys(6) // one shard loop, so failures hit one window
	rows := f.newRows(keys, 30)
	f.insert(rows)
	relay, _ := f.startRelay(cfg)
	f.waitDelivered(len(rows), 60*time.Second)
	f.requireExactlyOnceInOrder(rows)
	if st := relay.Stats(); st.Failures == 0 || st.Duplicates == 0 {
		t.Fatalf("stats %+v: the test meant to fail publishes and cause duplicates", st)
	}
	// Only the events stored with a lost ack are sent again and acked as
	// duplicates, once each: the relay resends nothing that was acked.
	mu.Lock()
	defer mu.Unlock()
	if st := relay.Stats(); st.Duplicates != uint64(len(storedUnacked)) || st.Published != uint64(len(rows)-len(storedUnacked)) {
		t.Errorf("relay acked %d events as new and %d as duplicates; want %d and %d (one duplicate per event stored with a lost ack)",
			st.Published, st.Duplicates, len(rows)-len(storedUnacked), len(storedUnacked))
	}
}

// The relay's ack subscription lives while shard loops run: a stopped
// relay leaves nothing behind on a connection that lives on, and one run
// again takes its acks anew.
func TestRelayStoppingDropsItsAckSubscription(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	for round := range 2 {
		rows := f.newRows([]string{fmt.Sprintf("r%d", round)}, 3)
		f.insert(rows)
		_, stop := f.startRelay(f.config())
		f.waitDelivered(3*(round+1), 10*time.Second)
		running := f.nc.NumSubscriptions()
		stop()
		if n := f.nc.NumSubscriptions(); n != running-1 {
			t.Fatalf("round %d: %d subscriptions on the connection after the relay stopped, want %d (its ack subscription gone)", round, n, running-1)
		}
	}
}

func TestRelayWakesOnNotifyWithoutPolling(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	cfg := f.config()
	cfg.PollInterval = time.Hour
	relay, _ := f.startRelay(cfg)
	deadline := time.Now().Add(10 * time.Second)
	for !relay.Stats().Listening {
		if time.Now().After(deadline) {
			t.Fatal("relay never started listening")
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // let the initial wake-up's reads finish
	for i := range 5 {
		rows := f.newRows([]string{fmt.Sprintf("n%d", i)}, 1)
		start := time.Now()
		f.insert(rows)
		if d := time.Since(start) + f.waitDelivered(i+1, 5*time.Second); d > 2*time.Second {
			t.Fatalf("event %d took %v to arrive: the notification did not wake the relay", i, d)
		}
	}
	requirePublishedOnce(t, relay, 5)
}

func TestRelayStreamSetup(t *testing.T) {
	t.Parallel()
	natsURL := kfntest.NATSURL(t)
	ctx := context.Background()

	t.Run("existing compatible stream is left alone", func(t *testing.T) {
		f := newRelayFixture(t, natsURL)
		_, err := f.js.CreateStream(ctx, jetstream.StreamConfig{
			Name: f.stream, Subjects: []string{f.subject + ".>", "other." + f.subject},
			Duplicates: 5 * time.Minute, Storage: jetstream.MemoryStorage,
		})
		if err != nil {
			t.Fatal(err)
		}
		cfg := f.config()
		cfg.Subjects = []string{f.subject + ".evt"}
		rows := f.newRows([]string{"a"}, 3)
		f.insert(rows)
		f.startRelay(cfg)
		f.waitDelivered(len(rows), 10*time.Second)
		s, err := f.js.Stream(ctx, f.stream)
		if err != nil {
			t.Fatal(err)
		}
		got := s.CachedInfo().Config
		if got.Duplicates != 5*time.Minute || got.Storage != jetstream.MemoryStorage || len(got.Subjects) != 2 {
			t.Fatalf("relay changed the existing stream: %+v", got)
		}
	})

	t.Run("missing stream is created bounded", func(t *testing.T) {
		f := newRelayFixture(t, natsURL)
		cfg := f.config()
		cfg.MaxAge = 90 * time.Minute
		rows := f.newRows([]string{"a"}, 2)
		f.insert(rows)
		f.startRelay(cfg)
		f.waitDelivered(len(rows), 10*time.Second)
		s, err := f.js.Stream(ctx, f.stream)
		if err != nil {
			t.Fatal(err)
		}
		if got := s.CachedInfo().Config; got.MaxAge != 90*time.Minute || got.Duplicates != DefaultDuplicates {
			t.Fatalf("relay created the stream with max age %v and duplicate window %v, want 1h30m and %v", got.MaxAge, got.Duplicates, DefaultDuplicates)
		}
	})

	t.Run("existing stream without the subjects is refused", func(t *testing.T) {
		f := newRelayFixture(t, natsURL)
		if _, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: f.stream, Subjects: []string{"elsewhere." + f.subject}}); err != nil {
			t.Fatal(err)
		}
		r, err := NewRelay(f.config())
		if err != nil {
			t.Fatal(err)
		}
		runCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		err = r.Run(runCtx)
		var mismatch *StreamMismatchError
		if !errors.As(err, &mismatch) || mismatch.Uncovered != f.subject+".>" {
			t.Fatalf("Run = %v, want a StreamMismatchError for %s.>", err, f.subject)
		}
	})
}

// A row whose subject the stream does not capture parks its key: other keys
// flow, the key's later events wait, and once the stream is widened the key
// resumes in order.
func TestRelayParksKeyWhoseSubjectTheStreamRejects(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	cfg := f.config()
	cfg.ParkFor = 300 * time.Millisecond
	good := f.newRows([]string{"good"}, 5)
	stuck := f.newRows([]string{"stuck"}, 4)
	stuck[1].Event.Subject = "outside." + f.subject // the key's second event
	f.insert(append(append([]Row{}, stuck...), good...))
	relay, _ := f.startRelay(cfg)

	// good's 5 events and stuck's first arrive; the rest of stuck waits.
	deadline := time.Now().Add(10 * time.Second)
	for f.streamMsgs() < len(good)+1 {
		if time.Now().After(deadline) {
			t.Fatalf("stream holds %d messages, want %d", f.streamMsgs(), len(good)+1)
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(700 * time.Millisecond) // past ParkFor: the key is retried and parked again
	if n := f.streamMsgs(); n != len(good)+1 {
		t.Fatalf("stream holds %d messages while the key is parked, want %d", n, len(good)+1)
	}
	if n := f.outboxCount(); n != len(stuck)-1 {
		t.Fatalf("outbox holds %d rows, want the parked key's %d", n, len(stuck)-1)
	}
	if relay.Stats().Parked == 0 {
		t.Fatal("stats count no parked key")
	}

	s, err := f.js.Stream(context.Background(), f.stream)
	if err != nil {
		t.Fatal(err)
	}
	conf := s.CachedInfo().Config
	conf.Subjects = append(conf.Subjects, "outside."+f.subject)
	if _, err := f.js.UpdateStream(context.Background(), conf); err != nil {
		t.Fatal(err)
	}
	f.waitDelivered(len(good)+len(stuck), 20*time.Second)
	f.requireExactlyOnceInOrder(append(append([]Row{}, stuck...), good...))
	requirePublishedOnce(t, relay, len(good)+len(stuck))
}

func TestRelayConfigValidation(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none") // never connects
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	valid := func() RelayConfig {
		return RelayConfig{Pool: pool, JetStream: struct{ jetstream.JetStream }{}, Subjects: []string{"a.>"}}
	}
	cases := []struct {
		field  string
		modify func(*RelayConfig)
	}{
		{"Pool", func(c *RelayConfig) { c.Pool = nil }},
		{"JetStream", func(c *RelayConfig) { c.JetStream = nil }},
		{"Stream", func(c *RelayConfig) { c.Stream = "bad.name" }},
		{"Subjects", func(c *RelayConfig) { c.Subjects = nil }},
		{"Subjects[1]", func(c *RelayConfig) { c.Subjects = []string{"a", "b..c"} }},
		{"BatchSize", func(c *RelayConfig) { c.BatchSize = -1 }},
		{"MaxInFlight", func(c *RelayConfig) { c.MaxInFlight = -3 }},
		{"PollInterval", func(c *RelayConfig) { c.PollInterval = -time.Second }},
		{"MaxLinger", func(c *RelayConfig) { c.Linger, c.MaxLinger = 30*time.Millisecond, 10*time.Millisecond }},
		{"RetryMin/RetryMax", func(c *RelayConfig) { c.RetryMin, c.RetryMax = time.Second, time.Millisecond }},
	}
	for _, tc := range cases {
		cfg := valid()
		tc.modify(&cfg)
		_, err := NewRelay(cfg)
		var cfgErr *RelayConfigError
		if !errors.As(err, &cfgErr) || cfgErr.Field != tc.field {
			t.Errorf("%s: NewRelay error = %v, want one naming %s", tc.field, err, tc.field)
		}
	}
	if _, err := NewRelay(valid()); err != nil {
		t.Fatalf("valid config refused: %v", err)
	}
	d := RelayConfig{}.WithDefaults()
	if d.Duplicates != 2*time.Minute || d.Stream == "" || d.BatchSize == 0 || d.MaxInFlight == 0 || d.Logger == nil {
		t.Fatalf("defaults not applied: %+v", d)
	}
}

// A shard's wait between reads starts at Linger after an empty read,
// doubles while reads keep finding rows, stops at MaxLinger, and is off
// when Linger is negative.
func TestNextLingerGrowsWhileBusyAndStartsOverWhenIdle(t *testing.T) {
	const base, most = 5 * time.Millisecond, 20 * time.Millisecond
	var got []time.Duration
	last := time.Duration(0)
	for range 4 {
		last = nextLinger(last, base, most)
		got = append(got, last)
	}
	want := []time.Duration{5 * time.Millisecond, 10 * time.Millisecond, 20 * time.Millisecond, 20 * time.Millisecond}
	if !slices.Equal(got, want) {
		t.Errorf("waits after busy batches = %v, want %v", got, want)
	}
	if d := nextLinger(0, base, most); d != base {
		t.Errorf("wait after an empty read = %v, want Linger %v", d, base)
	}
	if d := nextLinger(most, -1, most); d != 0 {
		t.Errorf("wait with Linger off = %v, want 0", d)
	}
}

// TestCoversSubjectAllocatesNothing: the WAL relay asks for every event it
// publishes (not parallel: AllocsPerRun counts the whole process).
func TestCoversSubjectAllocatesNothing(t *testing.T) {
	if n := testing.AllocsPerRun(100, func() { CoversSubject([]string{"kfn.>", "orders.*.x"}, "orders.created.x") }); n != 0 {
		t.Errorf("CoversSubject allocates %v times per call, want 0", n)
	}
}

func TestSubjectCovers(t *testing.T) {
	t.Parallel()
	cases := []struct {
		pattern, subject string
		want             bool
	}{
		{"orders.>", "orders.accepted", true},
		{"orders.>", "orders.a.b", true},
		{"orders.>", "orders", false},
		{"orders.*", "orders.accepted", true},
		{"orders.*", "orders.a.b", false},
		{"orders.*", "orders.>", false},
		{"orders.>", "orders.*", true},
		{"orders.accepted", "orders.accepted", true},
		{"orders.accepted", "orders.rejected", false},
		{">", "anything.at.all", true},
		{"*.x", "a.x", true},
	}
	for _, c := range cases {
		if got := subjectCovers(c.pattern, c.subject); got != c.want {
			t.Errorf("subjectCovers(%q, %q) = %v, want %v", c.pattern, c.subject, got, c.want)
		}
	}
	for _, s := range []string{"", "a..b", "a.b*", "a.>.b", "a b"} {
		if CheckSubjectPattern(s) == nil {
			t.Errorf("CheckSubjectPattern(%q) accepted it", s)
		}
	}
	for _, s := range []string{"", "a.*", "a.>", "a\x00b", "a.\xff", "a b"} {
		if CheckSubject(s) == nil {
			t.Errorf("CheckSubject(%q) accepted it", s)
		}
	}
	for _, s := range []string{"a", "a.b", "orders.created"} {
		if err := CheckSubject(s); err != nil {
			t.Errorf("CheckSubject(%q) = %v", s, err)
		}
	}
}

func TestBuildMessageHeaders(t *testing.T) {
	t.Parallel()
	row := &relayRow{
		EventID: "id-1", Subject: "a.b", Type: "a.b.v1", Key: "k1", Source: "fn",
		SourceTopic: "in", SourcePartition: 3, SourceOffset: 42, Data: []byte("d"),
		CreatedAt: time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC),
		Headers: map[string]string{
			"traceparent": "00-abc-def-01",
			"x-ok":        "yes",
			"ce-id":       "spoofed",       // the relay's own: overridden
			"Nats-Rollup": "all",           // steers JetStream: dropped
			"x-bad":       "line\r\nbreak", // cannot travel: dropped
			"bad name":    "v",             // cannot travel: dropped
		},
	}
	msg, dropped := buildMessage(row, "S", CloudEventsSourcePrefix+row.Source, nil)
	want := map[string]string{
		"ce-specversion": "1.0", "ce-id": "id-1", "ce-type": "a.b.v1", "ce-source": "kfn/fn",
		"ce-time": "2026-01-02T03:04:05.000006Z", "ce-subject": "k1", "kfn-key": "k1",
		"kfn-source-topic": "in", "kfn-source-partition": "3", "kfn-source-offset": "42",
		"traceparent": "00-abc-def-01", "x-ok": "yes",
		"Nats-Msg-Id": "id-1", "Nats-Expected-Stream": "S",
	}
	for k, v := range want {
		if got := msg.Header.Get(k); got != v {
			t.Errorf("header %s = %q, want %q", k, got, v)
		}
	}
	if len(msg.Header) != len(want) {
		t.Errorf("headers = %v, want exactly %v", msg.Header, want)
	}
	slices.Sort(dropped)
	if !slices.Equal(dropped, []string{"Nats-Rollup", "bad name", "x-bad"}) {
		t.Errorf("dropped = %v", dropped)
	}

	// A reused buffer carries nothing of the message before: the next row,
	// with a binary key and no headers of its own, gets only its own.
	var buf messageBuf
	buildMessage(row, "S", CloudEventsSourcePrefix+row.Source, &buf)
	next := &relayRow{EventID: "id-2", Subject: "a.c", Type: "a.c", Key: "\x00k", Source: "fn2", Data: []byte("e")}
	msg, _ = buildMessage(next, "S2", CloudEventsSourcePrefix+next.Source, &buf)
	fresh, _ := buildMessage(next, "S2", CloudEventsSourcePrefix+next.Source, nil)
	if msg.Subject != "a.c" || string(msg.Data) != "e" || !maps.EqualFunc(msg.Header, fresh.Header, slices.Equal) {
		t.Errorf("message built in a reused buffer = %s %q %v, want %s %q %v", msg.Subject, msg.Data, msg.Header, fresh.Subject, fresh.Data, fresh.Header)
	}
	// Rows whose key travels one way, then another, with and without
	// headers of their own, one after the other through one buffer: each
	// message is the one a fresh buffer gives (those with the relay's
	// headers only and the same key headers as the one before are written
	// over it in place).
	seq := []relayRow{
		{EventID: "a1", Subject: "a.b", Key: "k1"}, {EventID: "a2", Subject: "a.c", Key: "k2"},
		{EventID: "a3", Subject: "a.b", Key: "\x00bin"}, {EventID: "a4", Subject: "a.b", Key: "\x01bin"},
		{EventID: "a5", Subject: "a.b", Key: ""}, {EventID: "a6", Subject: "a.b", Key: ""},
		{EventID: "a7", Subject: "a.b", Key: "k7", Headers: map[string]string{"x-h": "1"}}, {EventID: "a8", Subject: "a.b", Key: "k8"},
		{EventID: "a9", Subject: "a.b", Key: "k9"}, {EventID: "a10", Subject: "a.b", Key: "k10"},
	}
	for i := range seq {
		r := &seq[i]
		r.Type, r.Source, r.SourceTopic, r.SourceOffset, r.CreatedAt = r.Subject, "fn", "in", int64(i), row.CreatedAt.Add(time.Duration(i)*time.Second)
		msg, _ = buildMessage(r, "S", CloudEventsSourcePrefix+r.Source, &buf)
		fresh, _ := buildMessage(r, "S", CloudEventsSourcePrefix+r.Source, nil)
		if !maps.EqualFunc(msg.Header, fresh.Header, slices.Equal) {
			t.Errorf("%s (key %q) built after %s in a reused buffer: headers\n%v\nwant\n%v", r.EventID, r.Key, seq[max(i-1, 0)].EventID, msg.Header, fresh.Header)
		}
		if i == 8 {
			// A publish span writes its trace context into the message
			// (startPublish); the next message carries none of it.
			natsHeaderCarrier(msg.Header).Set(HeaderTraceState, "vendor=stale")
		}
	}
	// A row committed with the one before shares its ce-time; one committed
	// at another time gets its own.
	same, later := *row, *row
	same.EventID, later.EventID = "id-3", "id-4"
	later.CreatedAt = row.CreatedAt.Add(time.Microsecond)
	for _, r := range []*relayRow{row, &same, &later} {
		msg, _ = buildMessage(r, "S", CloudEventsSourcePrefix+r.Source, &buf)
		if got, want := msg.Header.Get(HeaderTime), r.CreatedAt.UTC().Format(time.RFC3339Nano); got != want {
			t.Errorf("%s: ce-time from a reused buffer = %q, want %q", r.EventID, got, want)
		}
	}
}
