package runtime_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestNATSTriggeredFunctionAppliesEachEventOnce publishes events with
// Nats-Msg-Id headers, then publishes them again after the stream's
// duplicate window, so JetStream stores every event twice. The function must
// apply each once (its inbox key is the event id), retry a transient
// failure, dead-letter a permanent one, and ack everything it committed.
func TestNATSTriggeredFunctionAppliesEachEventOnce(t *testing.T) {
	b := setup(t, 1)
	ctx := context.Background()
	js := jetStream(t, b.cfg.NATSURL)
	stream, subject := kfntest.Name(t, "stream"), kfntest.Name(t, "subj")+".created"
	const window = 200 * time.Millisecond
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}, Duplicates: window}); err != nil {
		t.Fatal(err)
	}
	publish := func(id, data string) {
		t.Helper()
		msg := nats.NewMsg(subject)
		msg.Header.Set("Nats-Msg-Id", id)
		msg.Header.Set("kfn-key", "key-"+id)
		msg.Data = []byte(data)
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	const events = 60
	for round := 0; round < 2; round++ {
		for i := 0; i < events; i++ {
			data := "ok"
			switch i {
			case 10:
				data = "permanent"
			case 20:
				data = "fail-1"
			}
			publish(fmt.Sprintf("ev-%02d", i), data)
		}
		time.Sleep(2 * window) // past the window: the second round is stored again
	}
	info, err := js.Stream(ctx, stream)
	if err != nil || info.CachedInfo().State.Msgs != 2*events {
		t.Fatalf("stream holds %d messages (%v), want %d: the duplicate window should not have dropped the second round", info.CachedInfo().State.Msgs, err, 2*events)
	}

	table := pgx.Identifier{"events_" + b.fn}.Sanitize()
	fn := runtime.Function{
		Name: b.fn, Subject: subject, Stream: stream,
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` (event_id text, key text, attempt int)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			switch string(rec.Value) {
			case "permanent":
				return runtime.Permanent(errors.New("bad event"))
			case "fail-1":
				if rec.Attempt == 1 {
					return errors.New("transient")
				}
			}
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1, $2, $3)`, rec.EventID, string(rec.Key), rec.Attempt)
			return err
		},
	}
	w, stop := b.run(t, fn)
	b.waitEventsDone(t, js, stream, events, 30*time.Second)
	stop()
	// JetStream stored each event twice; the inbox is what kept the second
	// copies out, so it must have skipped exactly those.
	wantDuplicates(t, w, events, "the inbox skips the second copy of each event, the dead-lettered one's too")

	var applied, distinct, retried int
	err = b.pg.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id), count(*) FILTER (WHERE attempt = 2) FROM `+table).Scan(&applied, &distinct, &retried)
	if err != nil {
		t.Fatal(err)
	}
	if applied != events-1 || distinct != events-1 || retried != 1 {
		t.Errorf("applied %d rows for %d distinct events (%d on a retry), want %d, %d and 1", applied, distinct, retried, events-1, events-1)
	}
	var key string
	if err := b.pg.Pool.QueryRow(ctx, `SELECT key FROM `+table+` WHERE event_id = 'ev-05'`).Scan(&key); err != nil || key != "key-ev-05" {
		t.Errorf("key of ev-05 = %q (%v), want the kfn-key header", key, err)
	}
	dead, err := inbox.ListDeadLetters(ctx, b.pg.Pool, b.fn, 10)
	if err != nil || len(dead) != 1 || dead[0].Reason != "permanent" || dead[0].Partition.Topic != subject {
		t.Errorf("dead letters = %+v (%v), want the one permanent event", dead, err)
	}
}

// TestNATSTriggeredFunctionTakesOverUnackedEventsAtOnce leaves events
// fetched but unacknowledged by a previous owner that died. The new owner
// must get them in seconds, not after the consumer's two-minute ack wait.
func TestNATSTriggeredFunctionTakesOverUnackedEventsAtOnce(t *testing.T) {
	b := setup(t, 1)
	ctx := context.Background()
	js := jetStream(t, b.cfg.NATSURL)
	stream, subject := kfntest.Name(t, "stream"), kfntest.Name(t, "subj")+".created"
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20; i++ {
		msg := nats.NewMsg(subject)
		msg.Header.Set("Nats-Msg-Id", fmt.Sprintf("ev-%02d", i))
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	// The previous owner: it committed and acked 3 events, fetched 7 more
	// and died before acking them.
	dead, err := js.CreateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable: b.fn, FilterSubject: subject, AckPolicy: jetstream.AckExplicitPolicy, AckWait: 2 * time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
	batch, err := dead.Fetch(10, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	fetched := 0
	for m := range batch.Messages() {
		if fetched < 3 {
			if err := m.DoubleAck(ctx); err != nil {
				t.Fatal(err)
			}
		}
		fetched++
	}
	if fetched != 10 {
		t.Fatalf("the dead owner fetched %d events, want 10", fetched)
	}

	fn, table := eventRecorder(b, subject, stream)
	_, stop := b.run(t, fn)
	waitFor(t, 15*time.Second, "the 17 events after the ack floor, well before the 2-minute ack wait", func() bool {
		var n int
		err := b.pg.Pool.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM `+table).Scan(&n)
		return err == nil && n == 17
	})
	cons, err := js.Consumer(ctx, stream, b.fn)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 15*time.Second, "every event acked", func() bool {
		ci, err := cons.Info(ctx)
		return err == nil && ci.NumPending == 0 && ci.NumAckPending == 0
	})
	stop()
	// Counted by row, not by distinct id: an event applied twice (the dead
	// owner's 7 unacked ones are delivered again) must show.
	rows, err := b.pg.Pool.Query(ctx, `SELECT event_id FROM `+table+` ORDER BY event_id`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for i := 3; i < 20; i++ {
		want = append(want, fmt.Sprintf("ev-%02d", i))
	}
	if !slices.Equal(got, want) {
		t.Errorf("applied events %v, want each of ev-03…ev-19 once", got)
	}
}

// eventRecorder is a NATS-triggered function of b on subject in stream
// that writes a row per applied event (its id) into table, with no unique
// key: an event applied twice shows as two rows.
func eventRecorder(b *bundle, subject, stream string) (fn runtime.Function, table string) {
	table = pgx.Identifier{"events_" + b.fn}.Sanitize()
	return runtime.Function{
		Name: b.fn, Subject: subject, Stream: stream,
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` (event_id text)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1)`, rec.EventID)
			return err
		},
	}, table
}

// jetStream connects to NATS for the duration of the test.
// waitEventsDone waits until the test's function has handled `handled`
// events (its event inbox rows) and its durable consumer on stream has
// none left pending or unacknowledged.
func (b *bundle) waitEventsDone(t *testing.T, js jetstream.JetStream, stream string, handled int, limit time.Duration) {
	t.Helper()
	ctx := context.Background()
	waitFor(t, limit, fmt.Sprintf("%d events handled and every one acked", handled), func() bool {
		var n int
		if err := b.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.event_inbox WHERE consumer = $1`, b.fn).Scan(&n); err != nil || n != handled {
			return false
		}
		cons, err := js.Consumer(ctx, stream, b.fn)
		if err != nil {
			return false
		}
		ci, err := cons.Info(ctx)
		return err == nil && ci.NumPending == 0 && ci.NumAckPending == 0
	})
}

func jetStream(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// TestEventStreamIsCreatedBounded checks the stream a worker creates keeps
// events for the configured retention and drops republished ids inside the
// configured window, so nothing in it grows without bound, and that it
// captures the function's subjects even when the worker leaves relaying to
// another process (--no-relay).
func TestEventStreamIsCreatedBounded(t *testing.T) {
	for _, noRelay := range []bool{false, true} {
		t.Run(fmt.Sprintf("no-relay=%v", noRelay), func(t *testing.T) {
			b := setup(t, 1)
			b.cfg.EventStream = kfntest.Name(t, "events")
			b.cfg.EventDedup = 90 * time.Second
			b.cfg.EventRetention = 36 * time.Hour
			b.cfg.NoRelay = noRelay
			w, stop := b.run(t, effects.Function(b.fn, b.topic))
			defer stop()
			if _, relaying := w.RelayStats(); relaying == noRelay {
				t.Errorf("worker runs a relay: %v, want %v", relaying, !noRelay)
			}
			stream, err := jetStream(t, b.cfg.NATSURL).Stream(context.Background(), b.cfg.EventStream)
			if err != nil {
				t.Fatal(err)
			}
			cfg := stream.CachedInfo().Config
			if cfg.MaxAge != 36*time.Hour || cfg.Duplicates != 90*time.Second || cfg.Storage != jetstream.FileStorage || !slices.Contains(cfg.Subjects, effects.Subject(b.fn)) {
				t.Errorf("stream config: max age %s, duplicates %s, storage %v, subjects %v; want 36h, 90s, file, and the function's subject",
					cfg.MaxAge, cfg.Duplicates, cfg.Storage, cfg.Subjects)
			}
		})
	}
}

// TestNATSTriggeredFunctionGetsAnEventWhoseDeliveryWasLost has a delivery
// of the lane's consumer go where the lane never sees it, as one in flight
// when a NATS server between the consumer and the worker dies: JetStream
// counts it as delivered, and the worker's next pull gets the events after
// it. The lane acks with AckAll, so it must not ack past the lost one: the
// event must be applied in seconds, not lost (nor left to the consumer's
// two-minute ack wait). The lost delivery is made by a second pull request
// on the lane's consumer, which JetStream serves in turn with the lane's.
func TestNATSTriggeredFunctionGetsAnEventWhoseDeliveryWasLost(t *testing.T) {
	b := setup(t, 1)
	ctx := context.Background()
	js := jetStream(t, b.cfg.NATSURL)
	stream, subject := kfntest.Name(t, "stream"), kfntest.Name(t, "subj")+".created"
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}}); err != nil {
		t.Fatal(err)
	}
	publish := func(from, to int) {
		t.Helper()
		for i := from; i < to; i++ {
			msg := nats.NewMsg(subject)
			msg.Header.Set("Nats-Msg-Id", fmt.Sprintf("ev-%02d", i))
			if _, err := js.PublishMsg(ctx, msg); err != nil {
				t.Fatal(err)
			}
		}
	}
	fn, table := eventRecorder(b, subject, stream)
	_, stop := b.run(t, fn)
	defer stop()
	var cons jetstream.Consumer
	waitFor(t, 15*time.Second, "the lane's consumer", func() bool {
		var err error
		cons, err = js.Consumer(ctx, stream, b.fn)
		return err == nil
	})
	// waitingPulls waits until n pull requests wait on the lane's consumer:
	// the lane's own, then the lane's and the test's, so that the events
	// published after reach both (a fixed sleep lost that race on a loaded
	// machine).
	waitingPulls := func(n int) {
		t.Helper()
		waitFor(t, 15*time.Second, fmt.Sprintf("%d pull requests waiting on the lane's consumer", n), func() bool {
			info, err := cons.Info(ctx)
			return err == nil && info.NumWaiting >= n
		})
	}
	waitingPulls(1)
	type stolen struct {
		id  string
		err error
	}
	lost := make(chan stolen, 1)
	go func() {
		batch, err := cons.Fetch(1, jetstream.FetchMaxWait(20*time.Second))
		if err != nil {
			lost <- stolen{err: err}
			return
		}
		s := stolen{err: errors.New("no delivery")}
		for m := range batch.Messages() {
			s = stolen{id: m.Headers().Get("Nats-Msg-Id")} // never acked
		}
		if s.err == nil {
			s.err = batch.Error()
		}
		lost <- s
	}()
	waitingPulls(2)
	publish(0, 10)
	s := <-lost
	if s.err != nil {
		t.Fatalf("the second pull request got no event: %v", s.err)
	}
	t.Logf("the delivery of %s was lost", s.id)
	publish(10, 20) // later deliveries to the lane, which it acks
	waitFor(t, 20*time.Second, "all 20 events, the lost one too, well before the 2-minute ack wait", func() bool {
		var n int
		err := b.pg.Pool.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM `+table+` WHERE event_id = $1`, s.id).Scan(&n)
		var all int
		err2 := b.pg.Pool.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM `+table).Scan(&all)
		return err == nil && err2 == nil && n == 1 && all == 20
	})
	var rows int
	if err := b.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&rows); err != nil || rows != 20 {
		t.Errorf("applied %d rows (%v), want each of the 20 events once", rows, err)
	}
}
