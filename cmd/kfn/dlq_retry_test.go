package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// A poison record is dead-lettered. Retried before the fix, it fails
// again: the letter stays with one more attempt and the partition goes on.
// Retried after the fix, it is applied once and emits its event once, with
// the id a first apply would have given it; retrying it again applies
// nothing. An oversized record is refused.
func TestDLQRetryAppliesAFixedRecordOnceAndAFailedRetryKeepsTheLetter(t *testing.T) {
	db := kfntest.Postgres(t)
	k := kfntest.Kafka(t)
	natsURL := kfntest.NATSURL(t)
	topic := k.CreateTopic(t, 1)
	name := kfntest.Name(t, "retry")
	var fixed atomic.Bool
	fn := effects.Function(name, topic)
	apply := fn.Handler
	fn.Handler = func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
		if string(rec.Value) == "poison" && !fixed.Load() {
			return runtime.Permanent(errors.New("poison pill: the decoder cannot read it"))
		}
		return apply(ctx, tx, rec, out)
	}
	big := strings.Repeat("x", 8<<10)
	values := []string{"a", "b", "poison", "c", big, "d"}
	for _, v := range values {
		k.Produce(t, topic, kafka.Message{Key: []byte("k"), Value: []byte(v), Headers: []kafka.Header{{Key: "h", Value: []byte{0, 0xff}}}})
	}
	ctx := context.Background()
	cfg := operatorTestConfig(k, db.URL, natsURL, kfntest.Name(t, "leases"))
	cfg.MaxRecordBytes, cfg.RetryAttempts, cfg.RetryInitial = 4<<10, 2, 10*time.Millisecond
	w, stop := startWorker(t, cfg, fn)
	cursor := func() int64 {
		var next int64
		if err := db.Pool.QueryRow(ctx, `SELECT coalesce(max(next_offset), -1) FROM kfn.cursors WHERE consumer = $1`, name).Scan(&next); err != nil {
			t.Fatal(err)
		}
		return next
	}
	waitFor(t, "the partition to reach offset 6", func() bool { return cursor() == 6 })
	letter := func(offset int) (id int64, attempts int, lastErr *string) {
		err := db.Pool.QueryRow(ctx, `SELECT id, attempts, last_retry_error FROM kfn.dead_letters WHERE consumer = $1 AND "offset" = $2`, name, offset).
			Scan(&id, &attempts, &lastErr)
		if errors.Is(err, pgx.ErrNoRows) {
			return 0, 0, nil
		}
		if err != nil {
			t.Fatal(err)
		}
		return id, attempts, lastErr
	}
	poison, attempts, _ := letter(2)
	oversized, _, _ := letter(4)
	if poison == 0 || attempts != 1 || oversized == 0 {
		t.Fatalf("dead letters: poison %d (attempts %d), oversized %d; want both dead-lettered", poison, attempts, oversized)
	}
	base := []string{"dlq", "retry", "--database-url", db.URL}
	id := strconv.FormatInt(poison, 10)

	code, _, stderr := kfn(t, append(base, "--id", id)...)
	if code != 2 || !strings.Contains(stderr, "--reason is required") {
		t.Errorf("retry without a reason: exit %d, stderr %q; want a usage error", code, stderr)
	}
	code, out, stderr := kfn(t, append(base, "--id", strconv.FormatInt(oversized, 10), "--reason", "try")...)
	if code != 1 || !strings.Contains(out, "oversized") || !strings.Contains(out, "kfn replay") || !strings.Contains(stderr, "1 refused") {
		t.Errorf("retry of the oversized letter: exit %d, out %q, err %q; want it refused, pointing at kfn replay", code, out, stderr)
	}

	// Before the fix: it fails again, the letter stays, the lane goes on.
	code, out, stderr = kfn(t, append(base, "--function", name, "--dead-reason", "permanent", "--reason", "INC-7: try again", "--wait", "--json")...)
	var report struct {
		Marked   []inbox.RetryMark `json:"marked"`
		Outcomes []struct {
			ID      int64  `json:"id"`
			Outcome string `json:"outcome"`
			Error   string `json:"error"`
			By      string `json:"by"`
		} `json:"outcomes"`
	}
	if err := json.Unmarshal([]byte(out), &report); err != nil || code != 1 || len(report.Outcomes) != 1 ||
		report.Outcomes[0].ID != poison || report.Outcomes[0].Outcome != "failed" || !strings.Contains(report.Outcomes[0].Error, "poison pill") ||
		report.Outcomes[0].By != "worker-1" {
		t.Fatalf("retry before the fix: exit %d, out %s, err %q (%v); want the poison letter failed again", code, out, stderr, err)
	}
	t.Logf("$ kfn dlq retry --function %s --dead-reason permanent --reason … --wait --json (before the fix)\n%s", name, out)
	if _, attempts, lastErr := letter(2); attempts != 2 || lastErr == nil || !strings.Contains(*lastErr, "poison pill") {
		t.Errorf("letter after the failed retry: attempts %d, last error %v; want 2 and the error", attempts, lastErr)
	}
	k.Produce(t, topic, kafka.Message{Key: []byte("k"), Value: []byte("e")}, kafka.Message{Key: []byte("k"), Value: []byte("f")})
	waitFor(t, "the records after the failed retry to be applied", func() bool { return cursor() == 8 })

	// After the fix: applied once.
	fixed.Store(true)
	code, out, stderr = kfn(t, append(base, "--id", id, "--reason", "INC-7: decoder fixed", "--actor", "alice", "--wait")...)
	if code != 0 || !strings.Contains(out, " applied") || !strings.Contains(out, "applied 1, failed again 0") {
		t.Fatalf("retry after the fix: exit %d, out %q, err %q; want it applied", code, out, stderr)
	}
	t.Logf("$ kfn dlq retry --id %s --reason … --actor alice --wait\n%s", id, out)
	code, out, stderr = kfn(t, append(base, "--id", id, "--reason", "again")...)
	if code != 1 || !strings.Contains(out, "no such dead letter") {
		t.Errorf("second retry of the applied letter: exit %d, out %q, err %q; want it refused", code, out, stderr)
	}
	code, _, stderr = kfn(t, append(base, "--function", name, "--dead-reason", "permanent", "--reason", "again")...)
	if code != 1 || !strings.Contains(stderr, "no dead letter of function "+name+" matches") {
		t.Errorf("retry by filter with nothing left: exit %d, err %q", code, stderr)
	}
	if st := w.Stats(); st.DeadLetterRetriesApplied.Load() != 1 || st.DeadLetterRetriesFailed.Load() != 1 {
		t.Errorf("stats: retries applied %d, failed %d; want 1 and 1", st.DeadLetterRetriesApplied.Load(), st.DeadLetterRetriesFailed.Load())
	}
	srv := httptest.NewServer(w.HTTPHandler())
	resp, err := srv.Client().Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	srv.Close()
	for _, want := range []string{`kfn_dead_letter_retries_total{function="` + name + `",outcome="applied",worker="worker-1"} 1`, `kfn_dead_letter_retries_total{function="` + name + `",outcome="failed",worker="worker-1"} 1`} {
		if !strings.Contains(string(metrics), want) {
			t.Errorf("metrics lack %s", want)
		}
	}

	waitFor(t, "the relay to publish every event", func() bool {
		var n int
		return db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.outbox WHERE source = $1`, name).Scan(&n) == nil && n == 0
	})
	stop()
	_, js, err := connect.NATS(natsURL, "test")
	if err != nil {
		t.Fatal(err)
	}
	produced := make([]effects.Produced, 8)
	for i := range produced {
		produced[i] = effects.Produced{Partition: 0, Offset: int64(i)}
	}
	rep, err := effects.Check(ctx, db.Pool, name, topic, produced, effects.Events(js, runtime.DefaultStream))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("checker: %s", rep)
	if v := rep.Violations(produced[4]); len(v) > 0 || rep.Retried != 1 {
		t.Errorf("exactly-once violated: %v (retried %d, want 1)", v, rep.Retried)
	}
	ids := streamEventIDs(t, js, effects.Subject(name))
	want := outbox.EventID(name, outbox.SourceID(topic, 0, 2, "", 0), 0)
	if got := ids[2]; len(got) != 1 || got[0] != want {
		t.Errorf("events of the retried record in the stream = %v; want exactly %s, the id of a first apply", got, want)
	}
	var audits map[string]int
	rows, err := db.Pool.Query(ctx, `SELECT action, count(*) FROM kfn.audit_log WHERE consumer = $1 AND action LIKE 'dlq_retry%' GROUP BY 1`, name)
	if err == nil {
		audits = map[string]int{}
		var action string
		var n int
		_, err = pgx.ForEachRow(rows, []any{&action, &n}, func() error { audits[action] = n; return nil })
	}
	if err != nil || audits[inbox.ActionRetryRequested] != 2 || audits[inbox.ActionRetryFailed] != 1 || audits[inbox.ActionRetryApplied] != 1 {
		t.Errorf("retry audit rows = %v, %v; want 2 requested, 1 failed, 1 applied", audits, err)
	}
}

// streamEventIDs reads every event on subject and returns their ids by
// source offset.
func streamEventIDs(t *testing.T, js jetstream.JetStream, subject string) map[int64][]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, runtime.DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		t.Fatal(err)
	}
	total := int(info.State.Subjects[subject])
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject}})
	if err != nil {
		t.Fatal(err)
	}
	out := map[int64][]string{}
	for read := 0; read < total; read++ {
		m, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
		if err != nil {
			t.Fatal(err)
		}
		offset, _ := strconv.ParseInt(m.Headers().Get(outbox.HeaderSourceOffset), 10, 64)
		out[offset] = append(out[offset], m.Headers().Get(jetstream.MsgIDHeader))
	}
	return out
}

func TestDLQRetryBadInvocationsAreUsageErrors(t *testing.T) {
	db := []string{"dlq", "retry", "--database-url", "postgres://x@y/z"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"dlq", "retry", "--database-url", "", "--id", "1", "--reason", "r"}, "--database-url is required"},
		{append(db, "--function", "f"), "--reason is required"},
		{append(db, "--reason", "r"), "say which dead letters to retry"},
		{append(db, "--id", "0", "--reason", "r"), `"0" is not a dead letter id`},
		{append(db, "--id", "1,x", "--reason", "r"), `"x" is not a dead letter id`},
		{append(db, "--function", "f", "--partition", "-2", "--reason", "r"), "--partition must be 0 or more"},
		{append(db, "--function", "f", "--limit", "0", "--reason", "r"), "--limit must be at least 1"},
		{append(db, "--function", "f", "--wait", "--timeout", "0s", "--reason", "r"), "--timeout must be positive"},
	} {
		code, _, stderr := kfn(t, tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("kfn %q = exit %d, stderr %q; want exit 2 and %q", tc.args, code, stderr, tc.want)
		}
	}
}
