package console

import (
	"context"
	"fmt"
	"html"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// The verify page runs kfn verify over the range its form gives
// (partitions, from, to) and shows the offsets it checked with the
// verdict: a range holding a lost record finds it, one past it is clean,
// and a bad range is an error on the page, escaped, that names the field.
func TestVerifyPageChecksARange(t *testing.T) {
	k := kfntest.Kafka(t)
	st := setup(t, func(cfg *Config) { cfg.KafkaBrokers = k.Brokers })
	topic := k.CreateTopic(t, 2)
	ctx := context.Background()
	msgs := make([]kafka.Message, 20)
	for i := range msgs {
		msgs[i] = kafka.Message{Partition: i % 2, Value: []byte(fmt.Sprint(i))}
	}
	k.Produce(t, topic, msgs...)
	w, err := worker.New(ctx, runtime.Config{
		KafkaBrokers: k.Brokers, DatabaseURL: st.db.URL, NATSURL: kfntest.NATSURL(t), WorkerID: "worker-1",
		LeaseBucket: kfntest.Name(t, "leases"), BatchWait: 5 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})),
	}, runtime.Function{Name: "counter", Topic: topic,
		Handler: func(context.Context, pgx.Tx, runtime.Record, *runtime.Events) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	stop := kfntest.Background(t, "worker", w.Run)
	deadline := time.Now().Add(60 * time.Second)
	for count(t, st.db, `SELECT count(*) FROM kfn.inbox WHERE lane IN (SELECT id FROM kfn.lanes WHERE consumer = 'counter')`) != len(msgs) {
		if time.Now().After(deadline) {
			t.Fatal("timed out waiting for the worker to handle every record")
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	// Record 0@6 lost: no inbox row (the evidence without an effects query)
	// and no dead letter.
	if _, err := st.db.Pool.Exec(ctx, `DELETE FROM kfn.inbox WHERE "offset" = 6 AND lane = (SELECT id FROM kfn.lanes WHERE consumer = 'counter' AND partition = 0)`); err != nil {
		t.Fatal(err)
	}

	c := client(t)
	login(t, c, st.srv.URL, "victor", "victor-secret") // a viewer: verify only reads
	page := func(partitions, from, to string) string {
		t.Helper()
		q := url.Values{"function": {"counter"}, "topic": {topic}, "partitions": {partitions}, "from": {from}, "to": {to}}
		code, body := get(t, c, st.srv.URL, "/verify?"+q.Encode())
		if code != http.StatusOK {
			t.Fatalf("GET /verify?%s: %d\n%s", q.Encode(), code, body)
		}
		return html.UnescapeString(body)
	}
	for _, tc := range []struct {
		partitions, from, to string
		want                 []string
	}{
		{"0", "5", "8", []string{"Violations found", "Checked the range partitions 0 from 5 to 8 only", "<li>partition 0: offsets [5, 8), 0 pending</li>",
			"0@6 has no inbox row and no dead letter", `value="0"`, `value="5"`, `value="8"`}},
		{"0", "7", "", []string{"Clean: no violation", "Checked the range partitions 0 from 7 only", "<li>partition 0: offsets [7, 10), 0 pending</li>"}},
		{"", "", "6", []string{"Clean: no violation", "Checked the range partitions 0-1 to 6 only", "<li>partition 0: offsets [0, 6)", "<li>partition 1: offsets [0, 6)"}},
		{"", "", "", []string{"Violations found", "Checked the whole source", "<li>partition 1: offsets [0, 10), 0 pending</li>"}},
	} {
		body := page(tc.partitions, tc.from, tc.to)
		for _, want := range tc.want {
			if !strings.Contains(body, want) {
				t.Errorf("verify page for partitions %q from %q to %q: no %q in\n%s", tc.partitions, tc.from, tc.to, want, body)
			}
		}
	}
	for _, tc := range []struct{ partitions, from, to, want string }{
		{"0,<b>", "", "", `--partitions: "<b>" is not a partition id`},
		{"", "<script>alert(1)</script>", "", `--from: "<script>alert(1)</script>" is neither an offset`},
		{"4", "", "", "--partitions: topic " + topic + " has no partition 4: its partitions are 0-1"},
		{"", "9", "3", "--from: 9 is not below --to 3"},
	} {
		q := url.Values{"function": {"counter"}, "topic": {topic}, "partitions": {tc.partitions}, "from": {tc.from}, "to": {tc.to}}
		code, raw := get(t, c, st.srv.URL, "/verify?"+q.Encode())
		if code != http.StatusOK || !strings.Contains(html.UnescapeString(raw), tc.want) || strings.Contains(raw, "<script>") || strings.Contains(raw, "<b>") ||
			strings.Contains(raw, `id="verdict"`) {
			t.Errorf("verify page for partitions %q from %q to %q: %d; want the escaped error %q and no verdict in\n%s", tc.partitions, tc.from, tc.to, code, tc.want, raw)
		}
	}
}
