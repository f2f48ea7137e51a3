package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestRelayRejectsBadFlags(t *testing.T) {
	db := "postgres://x@127.0.0.1:1/z"
	ok := []string{"relay", "--database-url", db, "--nats-url", "nats://127.0.0.1:1", "--subjects", "orders.accepted"}
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"relay", "--database-url", "", "--nats-url", "nats://n", "--subjects", "a.b"}, "--database-url is required"},
		{[]string{"relay", "--database-url", db, "--nats-url", "", "--subjects", "a.b"}, "--nats-url is required"},
		{[]string{"relay", "--database-url", db, "--nats-url", "nats://n", "--subjects", " , "}, "--subjects is required"},
		{append(slices.Clone(ok), "--stats-every", "0s"), "--stats-every must be positive"},
		{append(slices.Clone(ok), "--event-dedup", "soon"), `--event-dedup "soon": "soon" is not a duration`},
		{append(slices.Clone(ok), "--no-such-flag"), "unknown flag --no-such-flag"},
		{append(slices.Clone(ok), "extra"), `unexpected argument "extra"`},
		// Checked by the runtime before it connects to anything.
		{append(slices.Clone(ok), "--subjects", "orders..accepted"), `"orders..accepted" is not a valid NATS subject`},
		{append(slices.Clone(ok), "--lease-ttl", "1s", "--lease-renew", "1s"), "--lease-ttl (KFN_LEASE_TTL): 1s must be at least 3 × --lease-renew"},
		{append(slices.Clone(ok), "--event-dedup", "-1s"), "--event-dedup (KFN_EVENT_DEDUP): must be positive"},
	}
	for _, tc := range cases {
		code, _, stderr := kfn(t, tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("kfn %q = exit %d, stderr %q; want exit 2 and %q", tc.args, code, stderr, tc.want)
		}
	}

	t.Setenv("KFN_LEASE_TTL", "five seconds")
	if code, _, stderr := kfn(t, ok...); code != 2 || !strings.Contains(stderr, `--lease-ttl (KFN_LEASE_TTL): "five seconds" is not a duration`) {
		t.Errorf("with a malformed KFN_LEASE_TTL: exit %d, stderr %q; want exit 2 naming the variable", code, stderr)
	}
}

// TestRelayProcessForwardsOutboxRows runs `kfn relay` as its own process
// against real Postgres and NATS: it extends an existing stream with the
// subjects it is given, relays rows committed with outbox.Insert before and
// while it runs (each once, with its event id as Nats-Msg-Id, in order per
// key), prints its counters, stops cleanly, exit 0, on SIGTERM, and
// flushes the span of each publish to the OTLP endpoint OTEL_* names.
func TestRelayProcessForwardsOutboxRows(t *testing.T) {
	bin := kfntest.BuildBinary(t, "github.com/kfn-dev/kfn/cmd/kfn")
	db := kfntest.Postgres(t)
	natsURL := kfntest.NATSURL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	js := jetStreamAt(t, natsURL)

	// The stream exists and captures one of the two subjects.
	streamName, prefix := kfntest.Name(t, "stream"), kfntest.Name(t, "ev")
	created, moved := prefix+".created", prefix+".moved"
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: streamName, Subjects: []string{created}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { js.DeleteStream(context.Background(), streamName) }) //nolint:errcheck

	var rows []outbox.Row
	insert := func(n int) {
		t.Helper()
		batch := make([]outbox.Row, n)
		for i := range batch {
			seq := len(rows) + i
			subject := created
			if seq%3 == 0 {
				subject = moved
			}
			origin := outbox.Origin{Consumer: "relay-test", Topic: "t", Offset: int64(seq), SourceID: outbox.KafkaSourceID("t", 0, int64(seq))}
			batch[i] = outbox.NewRow(origin, 0, fmt.Sprintf("key-%d", seq%7), outbox.Event{Subject: subject, Data: fmt.Appendf(nil, "%d", seq)})
		}
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Insert(ctx, tx, batch) }); err != nil {
			t.Fatal(err)
		}
		rows = append(rows, batch...)
	}
	insert(200) // a backlog before the relay starts

	// Tracing on, with spans exported only when the relay flushes them as
	// it stops (a ten-minute batch delay).
	traces := kfntest.StartOTLPReceiver(t)
	cmd := exec.Command(bin, "relay", "--database-url", db.URL, "--nats-url", natsURL,
		"--event-stream", streamName, "--subjects", created+","+moved, "--lease-bucket", kfntest.Name(t, "leases"),
		"--lease-ttl", "2s", "--lease-renew", "500ms", "--stats-every", "200ms", "--worker-id", "relay-1", "--metrics-addr", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), "OTEL_EXPORTER_OTLP_ENDPOINT="+traces.URL, "OTEL_BSP_SCHEDULE_DELAY=600000")
	p := kfntest.StartProcess(t, cmd)
	waitStored := func(n int) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			var left int
			if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.outbox`).Scan(&left); err != nil {
				t.Fatal(err)
			}
			st, err := js.Stream(ctx, streamName)
			if err == nil && left == 0 && st.CachedInfo().State.Msgs == uint64(n) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("after 30s: %d outbox rows left, stream info %v (%v), want 0 rows and %d messages\n%s", left, st, err, n, p.LogTail(30))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitStored(200)
	insert(100) // committed while it runs: woken by the notification
	waitStored(300)
	time.Sleep(300 * time.Millisecond) // one more stats line with everything published
	requireRelayMetrics(t, p)

	out := stopRelay(t, p)
	if err := p.ExitErr(); err != nil {
		t.Fatalf("kfn relay exited with %v after SIGTERM, want status 0:\n%s", err, out)
	}
	for _, want := range []string{"kfn relay: relaying the outbox to stream " + streamName, "stopped cleanly after publishing 300 events (0 duplicates"} {
		if !strings.Contains(out, want) {
			t.Errorf("kfn relay output lacks %q:\n%s", want, out)
		}
	}
	if !regexp.MustCompile(`published +300 .* shards 32 `).MatchString(out) {
		t.Errorf("kfn relay printed no stats line with 300 published events over its 32 shards:\n%s", out)
	}

	published := traces.Matching(func(s kfntest.Span) bool {
		return strings.HasPrefix(s.Name, "send ") && s.Attrs["messaging.operation.type"] == "send" && s.Service == "kfn-relay" && s.Attrs["kfn.stream"] == streamName
	})
	if len(published) != len(rows) {
		t.Errorf("%d send spans of service kfn-relay flushed at exit, want one per event (%d)", len(published), len(rows))
	}

	st, err := js.Stream(ctx, streamName)
	if err != nil {
		t.Fatal(err)
	}
	if subjects := st.CachedInfo().Config.Subjects; !slices.Contains(subjects, moved) {
		t.Errorf("stream subjects %v: --subjects did not extend the stream with %s", subjects, moved)
	}
	requireRelayed(t, js, streamName, rows)
}

// requireRelayMetrics scrapes the /metrics of a relay that relayed 300
// events (--metrics-addr, issue 12) and checks its /readyz.
func requireRelayMetrics(t *testing.T, p *kfntest.Process) {
	t.Helper()
	m := regexp.MustCompile(`serving /metrics, /healthz and /readyz on (\S+)`).FindStringSubmatch(p.LogTail(1000))
	if m == nil {
		t.Fatalf("kfn relay did not say where it serves its metrics:\n%s", p.LogTail(30))
	}
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get("http://" + m[1] + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	_, metrics := get("/metrics")
	for _, want := range []string{
		`kfn_outbox_published_total{worker="relay-1"} 300`,
		`kfn_outbox_ack_latency_seconds_count{worker="relay-1"} 300`,
		`kfn_outbox_backlog{worker="relay-1"} 0`,
		`kfn_outbox_oldest_age_seconds{worker="relay-1"} 0`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("kfn relay /metrics lacks %q:\n%s", want, metrics)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		code, body := get("/readyz")
		if code == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("kfn relay /readyz = %d %q after 10s", code, body)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if code, body := get("/healthz"); code != http.StatusOK {
		t.Errorf("kfn relay /healthz = %d %q", code, body)
	}
}

// requireRelayed reads the whole stream and checks that it holds each row
// once, under its event id, on its subject, and each key's rows in insert
// order.
func requireRelayed(t *testing.T, js jetstream.JetStream, stream string, rows []outbox.Row) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	byID := map[string]outbox.Row{}
	for _, r := range rows {
		byID[r.EventID] = r
	}
	seen := map[string]bool{}
	lastOfKey := map[string]int64{}
	for read := 0; read < len(rows); {
		batch, err := cons.Fetch(len(rows)-read, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			id := m.Headers().Get(jetstream.MsgIDHeader)
			r, ok := byID[id]
			switch {
			case !ok:
				t.Errorf("message with Nats-Msg-Id %q is not an inserted row", id)
				continue
			case seen[id]:
				t.Errorf("event %s is in the stream twice", id)
			case m.Subject() != r.Event.Subject || string(m.Data()) != string(r.Event.Data):
				t.Errorf("event %s: subject %s data %q, want %s and %q", id, m.Subject(), m.Data(), r.Event.Subject, r.Event.Data)
			}
			seen[id] = true
			if last, ok := lastOfKey[r.Event.Key]; ok && r.Origin.Offset < last {
				t.Errorf("key %s: row %d reached the stream after row %d", r.Event.Key, r.Origin.Offset, last)
			}
			lastOfKey[r.Event.Key] = r.Origin.Offset
		}
		if err := batch.Error(); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			t.Fatalf("stream %s: read %d of %d events, then nothing", stream, read, len(rows))
		}
		read += n
	}
	if len(seen) != len(rows) {
		t.Errorf("the stream holds %d of the %d rows", len(seen), len(rows))
	}
}

// TestRelayProcessPrintsTheWALFiguresInWALMode runs kfn relay on a
// database whose events are in the WAL outbox: its stats line says how
// many events it read from the slot, how many the stream has not acked,
// and how much WAL the slot holds.
func TestRelayProcessPrintsTheWALFiguresInWALMode(t *testing.T) {
	bin := kfntest.BuildBinary(t, "github.com/kfn-dev/kfn/cmd/kfn")
	db := kfntest.Postgres(t)
	natsURL := kfntest.NATSURL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	setup, err := outbox.SetUpWAL(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, setup.Slot) }) //nolint:errcheck
	js := jetStreamAt(t, natsURL)
	streamName, subject := kfntest.Name(t, "stream"), kfntest.Name(t, "ev")+".created"
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: streamName, Subjects: []string{subject}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { js.DeleteStream(context.Background(), streamName) }) //nolint:errcheck
	const events = 120
	batch := make([]outbox.Row, events)
	for i := range batch {
		origin := outbox.Origin{Consumer: "relay-wal-test", Topic: "t", Offset: int64(i), SourceID: outbox.KafkaSourceID("t", 0, int64(i))}
		batch[i] = outbox.NewRow(origin, 0, fmt.Sprintf("key-%d", i%7), outbox.Event{Subject: subject, Data: fmt.Appendf(nil, "%d", i)})
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Write(ctx, tx, outbox.ModeWAL, batch) }); err != nil {
		t.Fatal(err)
	}
	p := kfntest.StartProcess(t, exec.Command(bin, "relay", "--database-url", db.URL, "--nats-url", natsURL,
		"--event-stream", streamName, "--subjects", subject, "--lease-bucket", kfntest.Name(t, "leases"),
		"--lease-ttl", "2s", "--lease-renew", "500ms", "--stats-every", "200ms", "--worker-id", "relay-wal"))
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, err := js.Stream(ctx, streamName)
		if err == nil && st.CachedInfo().State.Msgs == events {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 30s the stream holds not %d events (%v):\n%s", events, err, p.LogTail(30))
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // a stats line with every event acked
	out := stopRelay(t, p)
	if !regexp.MustCompile(`published +120 .*  wal: read +120  unacked +0  WAL held \d+ bytes\n`).MatchString(out) {
		t.Errorf("kfn relay printed no stats line with the 120 events read from the slot, none unacked and the WAL held:\n%s", out)
	}
}

// stopRelay stops a kfn relay process with SIGTERM, as Kubernetes or
// podman stop it (Ctrl-C's SIGINT takes the same path), and returns what
// it printed.
func stopRelay(t *testing.T, p *kfntest.Process) string {
	t.Helper()
	if err := p.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Exited():
	case <-time.After(20 * time.Second):
		t.Fatalf("kfn relay did not stop within 20s of SIGTERM:\n%s", p.LogTail(30))
	}
	return p.LogTail(1000)
}

// jetStreamAt connects to the NATS server at url for the test's length and
// returns its JetStream.
func jetStreamAt(t *testing.T, url string) jetstream.JetStream {
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
