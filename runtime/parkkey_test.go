package runtime_test

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// keyed is one record to produce: its key (nil: none) and value.
type keyed struct {
	key   string // "" for a record with no key
	value string
}

// produceKeyed writes recs to one partition, in order, and returns where
// they landed.
func (b *bundle) produceKeyed(t *testing.T, partition int32, recs ...keyed) []effects.Produced {
	t.Helper()
	before := b.kafka.HighWatermarks(t, b.topic)[int(partition)]
	msgs := make([]kafka.Message, len(recs))
	out := make([]effects.Produced, len(recs))
	for i, r := range recs {
		msgs[i] = kafka.Message{Partition: int(partition), Value: []byte(r.value)}
		if r.key != "" {
			msgs[i].Key = []byte(r.key)
		}
		out[i] = effects.Produced{Partition: partition, Offset: before + int64(i)}
	}
	b.kafka.Produce(t, b.topic, msgs...)
	return out
}

// parkingFunction is the effects function with KeyOrder ParkKey whose
// handler fails permanently on the values in broken, until they are
// removed (the fix).
func parkingFunction(b *bundle, broken *sync.Map) runtime.Function {
	fn := effects.Function(b.fn, b.topic)
	fn.KeyOrder = runtime.ParkKey
	apply := fn.Handler
	fn.Handler = func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
		if _, bad := broken.Load(string(rec.Value)); bad {
			return runtime.Permanent(errors.New("broken: " + string(rec.Value)))
		}
		return apply(ctx, tx, rec, out)
	}
	return fn
}

// letter is a dead letter as a test looks at it.
type letter struct {
	id     int64
	reason string
	error  string
	marked bool
}

// letters returns the dead letters of b.fn on partition by offset.
func letters(t *testing.T, b *bundle, partition int32) map[int64]letter {
	t.Helper()
	rows, err := b.pg.Pool.Query(context.Background(), `
SELECT "offset", id, reason, error, retry_requested_at IS NOT NULL FROM kfn.dead_letters
 WHERE consumer = $1 AND topic = $2 AND partition = $3`, b.fn, b.topic, partition)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int64]letter{}
	var o int64
	var l letter
	if _, err := pgx.ForEachRow(rows, []any{&o, &l.id, &l.reason, &l.error, &l.marked}, func() error { out[o] = l; return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// countWhere counts rows of a query with b.fn as $1.
func countWhere(t *testing.T, b *bundle, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := b.pg.Pool.QueryRow(context.Background(), sql, append([]any{b.fn}, args...)...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// parkedKeys lists b.fn's rows of kfn.parked_keys as key@offset on
// partition.
func parkedKeys(t *testing.T, b *bundle, partition int32) []string {
	t.Helper()
	rows, err := b.pg.Pool.Query(context.Background(), `
SELECT convert_from(record_key, 'UTF8') || '@' || blocking_offset FROM kfn.parked_keys
 WHERE consumer = $1 AND partition = $2 ORDER BY record_key`, b.fn, partition)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// keyOrder returns the offsets of key's effects on partition, in commit
// order (see effects.insertSQL): the order the key's records were applied.
func keyOrder(t *testing.T, b *bundle, partition int32, key string) []int64 {
	t.Helper()
	rows, err := b.pg.Pool.Query(context.Background(), `SELECT "offset" FROM `+effects.Table(b.fn)+`
 WHERE partition = $1 AND key = $2 ORDER BY lsn, id`, partition, []byte(key))
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// wantKeyOrder requires key's records on partition applied exactly once
// each, in offset order, and exactly the ones in want.
func wantKeyOrder(t *testing.T, b *bundle, partition int32, key string, want []int64) {
	t.Helper()
	got := keyOrder(t, b, partition, key)
	if !slices.Equal(got, want) {
		t.Errorf("key %s on partition %d applied in commit order %v; want once each, in offset order: %v", key, partition, got, want)
	}
}

// retryIDs marks dead letters for retry by id and waits for the outcomes.
func retryIDs(t *testing.T, b *bundle, ids ...int64) (inbox.RetryMarks, []inbox.RetryOutcome) {
	t.Helper()
	ctx := context.Background()
	marks, err := operator.Retry(ctx, b.pg.Pool, operator.RetryRequest{IDs: ids, Partition: -1, Reason: "fixed", Actor: "test"})
	if err != nil {
		t.Fatal(err)
	}
	outcomes, err := operator.WaitRetries(ctx, b.pg.Pool, marks, 60*time.Second, 20*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	return marks, outcomes
}

// metric returns the value of the first sample of the worker's /metrics
// whose line matches pattern (a metric name and labels), or "" if none.
func metric(t *testing.T, w *worker.Worker, pattern string) string {
	t.Helper()
	rec := httptest.NewRecorder()
	w.HTTPHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	m := regexp.MustCompile(`(?m)^` + pattern + ` (\S+)$`).FindStringSubmatch(rec.Body.String())
	if m == nil {
		return ""
	}
	return m[1]
}

// With ParkKey, a record that fails parks the later records of its key on
// its partition (other keys, the same key on another partition and records
// without a key go on); once the handler is fixed, retrying the blocker
// applies it and then every parked record of the key in offset order,
// exactly once, while more records of the key keep coming; then the key is
// free and its new records apply directly.
func TestParkKeyHoldsAKeyBehindItsFailedRecordUntilItIsRetried(t *testing.T) {
	b := setup(t, 2)
	var broken sync.Map
	broken.Store("K-1", true)
	broken.Store("N-0", true)
	w, stop := b.run(t, parkingFunction(b, &broken))
	ctx := context.Background()

	produced := b.produceKeyed(t, 0,
		keyed{"K", "K-0"}, keyed{"J", "J-0"}, keyed{"K", "K-1"}, keyed{"J", "J-1"}, keyed{"K", "K-2"},
		keyed{"", "N-0"}, keyed{"K", "K-3"}, keyed{"J", "J-2"}, keyed{"", "N-1"})
	produced = append(produced, b.produceKeyed(t, 1, keyed{"K", "P1-K-0"}, keyed{"K", "P1-K-1"})...)
	noKey := produced[5]
	b.waitCaughtUp(t, b.fn)

	dead := letters(t, b, 0)
	reasons := map[int64]string{}
	for o, l := range dead {
		reasons[o] = l.reason
	}
	want := map[int64]string{2: "permanent", 4: inbox.ReasonKeyParked, 5: "permanent", 6: inbox.ReasonKeyParked}
	if fmt.Sprint(reasons) != fmt.Sprint(want) {
		t.Fatalf("dead letters of partition 0 by offset = %v; want %v", reasons, want)
	}
	if !strings.Contains(dead[4].error, "offset 2") {
		t.Errorf("a parked record's error = %q; want it to name the blocking offset 2", dead[4].error)
	}
	if got := parkedKeys(t, b, 0); !slices.Equal(got, []string{"K@2"}) {
		t.Errorf("parked keys of partition 0 = %v; want K behind offset 2 (a record with no key parks nothing)", got)
	}
	if got := parkedKeys(t, b, 1); len(got) != 0 {
		t.Errorf("parked keys of partition 1 = %v; want none: K's order is per partition", got)
	}
	// The worker counts a batch's parked records just after its commit,
	// so caught up in the database can come a moment before the count.
	waitFor(t, 10*time.Second, "the worker to count the 2 parked records", func() bool { return w.Stats().KeyParked.Load() >= 2 })
	if n := w.Stats().KeyParked.Load(); n != 2 {
		t.Errorf("records key_parked = %d, want 2", n)
	}
	gauge := `kfn_parked_keys\{function="` + regexp.QuoteMeta(b.fn) + `",worker="[^"]*"\}`
	if v := metric(t, w, gauge); v != "1" {
		t.Errorf("kfn_parked_keys = %q, want 1", v)
	}
	if v := metric(t, w, `kfn_records_key_parked_total\{function="`+regexp.QuoteMeta(b.fn)+`",worker="[^"]*"\}`); v != "2" {
		t.Errorf("kfn_records_key_parked_total = %q, want 2", v)
	}
	wantKeyOrder(t, b, 0, "J", []int64{1, 3, 7})
	wantKeyOrder(t, b, 1, "K", []int64{0, 1})

	// A parked record cannot be retried ahead of the record it waits for.
	marks, err := operator.Retry(ctx, b.pg.Pool, operator.RetryRequest{IDs: []int64{dead[4].id}, Partition: -1, Reason: "too early", Actor: "test"})
	if err != nil || len(marks.Marked) != 0 || len(marks.Refused) != 1 || !strings.Contains(marks.Refused[0].Refused, "parked behind dead letter") {
		t.Fatalf("retry of a parked record = %+v, %v; want it refused, naming its blocker", marks, err)
	}

	// More records of K pile up behind the blocker, across batches.
	var more []keyed
	for i := range 150 {
		more = append(more, keyed{"K", fmt.Sprintf("K-p%d", i)}, keyed{"J", fmt.Sprintf("J-p%d", i)})
	}
	produced = append(produced, b.produceKeyed(t, 0, more...)...)
	b.waitCaughtUp(t, b.fn)
	if n := countWhere(t, b, `SELECT count(*) FROM kfn.dead_letters WHERE consumer = $1 AND reason = $2`, inbox.ReasonKeyParked); n != 152 {
		t.Fatalf("%d records key_parked, want 152", n)
	}

	// The fix, then the retry of the blocker; records of K keep coming
	// while its parked records are applied (more than a lane's retry chunk).
	broken.Delete("K-1")
	marks, err = operator.Retry(ctx, b.pg.Pool, operator.RetryRequest{IDs: []int64{dead[2].id}, Partition: -1, Reason: "fixed", Actor: "test"})
	if err != nil || len(marks.Marked) != 1 {
		t.Fatalf("retry of the blocker = %+v, %v", marks, err)
	}
	for i := range 5 {
		var flow []keyed
		for j := range 10 {
			flow = append(flow, keyed{"K", fmt.Sprintf("K-f%d-%d", i, j)}, keyed{"J", fmt.Sprintf("J-f%d-%d", i, j)})
		}
		produced = append(produced, b.produceKeyed(t, 0, flow...)...)
		time.Sleep(30 * time.Millisecond)
	}
	outcomes, err := operator.WaitRetries(ctx, b.pg.Pool, marks, 60*time.Second, 20*time.Millisecond)
	if err != nil || outcomes[0].Outcome != inbox.RetryApplied {
		t.Fatalf("retry of the blocker: %+v, %v; want applied", outcomes, err)
	}
	waitFor(t, 60*time.Second, "K's parked records applied", func() bool {
		return countWhere(t, b, `SELECT count(*) FROM kfn.dead_letters WHERE consumer = $1 AND reason = $2`, inbox.ReasonKeyParked) == 0
	})
	// K is free: its next record applies directly.
	produced = append(produced, b.produceKeyed(t, 0, keyed{"K", "K-last"}, keyed{"J", "J-last"})...)
	b.waitCaughtUp(t, b.fn)
	waitFor(t, 30*time.Second, "kfn_parked_keys back to 0", func() bool { return metric(t, w, gauge) == "0" })
	if got := parkedKeys(t, b, 0); len(got) != 0 {
		t.Errorf("parked keys after the retry = %v, want none", got)
	}
	stop()

	rep := b.check(t, b.fn, produced, noKey)
	// Every record of K on partition 0 was applied (the checker says once),
	// and in offset order.
	rows, _ := b.pg.Pool.Query(ctx, `SELECT "offset" FROM `+effects.Table(b.fn)+` WHERE partition = 0 AND key = 'K' ORDER BY "offset"`)
	sortedK, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	if want := 4 + 150 + 50 + 1; len(sortedK) != want {
		t.Errorf("%d records of K applied on partition 0, want %d", len(sortedK), want)
	}
	wantKeyOrder(t, b, 0, "K", sortedK)
	if rep.Retried < 153 {
		t.Errorf("records applied by a retry = %d; want at least the blocker and its 152 parked records", rep.Retried)
	}
	// The release marked the 152 parked records, and those of the records
	// that came during the retry that were parked before it committed.
	var how string
	var marked int
	err = b.pg.Pool.QueryRow(ctx, `SELECT details->>'how', (details->>'marked_for_retry')::int FROM kfn.audit_log WHERE action = $1 AND consumer = $2`,
		inbox.ActionKeyReleased, b.fn).Scan(&how, &marked)
	if err != nil || how != "retried" || marked < 152 || marked > 202 {
		t.Errorf("key_released audit row: how %q, %d marked for retry (%v); want retried, 152 to 202", how, marked, err)
	}
}

// With ParkKey, an oversized record blocks its key too; discarding its dead
// letter releases the key: the blocker stays unapplied and the key's parked
// records are applied in offset order, then its new records directly.
func TestParkKeyReleasedByDiscardingTheBlocker(t *testing.T) {
	b := setup(t, 1)
	b.cfg.MaxRecordBytes = 300
	var broken sync.Map
	w, stop := b.run(t, parkingFunction(b, &broken))
	ctx := context.Background()

	produced := b.produceKeyed(t, 0,
		keyed{"K", "K-0"}, keyed{"K", strings.Repeat("x", 400)}, keyed{"J", "J-0"}, keyed{"K", "K-2"}, keyed{"J", "J-1"}, keyed{"K", "K-3"})
	b.waitCaughtUp(t, b.fn)
	dead := letters(t, b, 0)
	if len(dead) != 3 || dead[1].reason != "oversized" || dead[3].reason != inbox.ReasonKeyParked || dead[5].reason != inbox.ReasonKeyParked {
		t.Fatalf("dead letters = %+v; want 1 oversized, 3 and 5 parked behind it", dead)
	}
	wantKeyOrder(t, b, 0, "J", []int64{2, 4})

	res, err := operator.DiscardDeadLetters(ctx, b.pg.Pool, operator.DiscardRequest{
		Filter: operator.DeadLetterFilter{IDs: []int64{dead[1].id}}, Actor: "test", Reason: "INC-5: not to be re-driven"})
	if err != nil || len(res.DeadLetters) != 1 || len(res.Released) != 1 || string(res.Released[0].Key) != "K" || res.Released[0].Marked != 2 {
		t.Fatalf("discard of the blocker = %+v, %v; want K released with its 2 parked records marked", res, err)
	}
	waitFor(t, 30*time.Second, "K's parked records applied", func() bool { return len(letters(t, b, 0)) == 0 })
	produced = append(produced, b.produceKeyed(t, 0, keyed{"K", "K-4"})...)
	b.waitCaughtUp(t, b.fn)
	waitFor(t, 30*time.Second, "no parked key left in the lane", func() bool {
		for _, p := range w.Stats().Partitions() {
			if p.ParkedKeys != 0 {
				return false
			}
		}
		return true
	})
	stop()

	// The discarded record is neither applied nor dead-lettered any more:
	// leave it out of what the checker expects.
	b.check(t, b.fn, slices.Delete(slices.Clone(produced), 1, 2))
	wantKeyOrder(t, b, 0, "K", []int64{0, 3, 5, 6})
}

// With ParkKey, a parked record that fails when its key is released becomes
// the key's blocker: the records behind it stay parked (one marked by hand
// is held back, not applied), new records of the key park behind it, and
// retrying it once fixed releases the rest, in offset order.
func TestParkKeyAParkedRecordThatFailsOnReleaseBlocksTheKey(t *testing.T) {
	b := setup(t, 1)
	var broken sync.Map
	broken.Store("K-1", true)
	broken.Store("K-3", true)
	_, stop := b.run(t, parkingFunction(b, &broken))
	ctx := context.Background()

	produced := b.produceKeyed(t, 0,
		keyed{"K", "K-0"}, keyed{"K", "K-1"}, keyed{"K", "K-2"}, keyed{"K", "K-3"}, keyed{"K", "K-4"}, keyed{"J", "J-0"})
	b.waitCaughtUp(t, b.fn)
	dead := letters(t, b, 0)
	if len(dead) != 4 || dead[1].reason != "permanent" || dead[3].reason != inbox.ReasonKeyParked {
		t.Fatalf("dead letters = %+v; want 1 permanent, 2, 3 and 4 parked (3 never reached the handler)", dead)
	}

	broken.Delete("K-1") // K-3 is still broken
	if _, outcomes := retryIDs(t, b, dead[1].id); outcomes[0].Outcome != inbox.RetryApplied {
		t.Fatalf("retry of the blocker: %+v; want applied", outcomes)
	}
	waitFor(t, 30*time.Second, "K-3 to fail and block K", func() bool {
		l := letters(t, b, 0)
		return len(l) == 2 && l[3].reason == "permanent" && !l[4].marked
	})
	dead = letters(t, b, 0)
	if dead[4].reason != inbox.ReasonKeyParked || !strings.Contains(dead[4].error, "offset 3") {
		t.Errorf("K-4's letter = %+v; want it parked behind offset 3", dead[4])
	}
	if got := parkedKeys(t, b, 0); !slices.Equal(got, []string{"K@3"}) {
		t.Errorf("parked keys = %v, want K behind offset 3", got)
	}
	wantKeyOrder(t, b, 0, "K", []int64{0, 1, 2})

	// New records of K park behind the new blocker.
	produced = append(produced, b.produceKeyed(t, 0, keyed{"K", "K-5"}, keyed{"J", "J-1"})...)
	b.waitCaughtUp(t, b.fn)
	if l := letters(t, b, 0)[6]; l.reason != inbox.ReasonKeyParked || !strings.Contains(l.error, "offset 3") {
		t.Errorf("K-5's letter = %+v; want it parked behind offset 3", l)
	}

	// K-4 cannot be marked ahead of K-3; marked anyway (as a race with a
	// release could), the lane holds it back.
	marks, err := operator.Retry(ctx, b.pg.Pool, operator.RetryRequest{IDs: []int64{dead[4].id}, Partition: -1, Reason: "too early", Actor: "test"})
	if err != nil || len(marks.Refused) != 1 || !strings.Contains(marks.Refused[0].Refused, fmt.Sprintf("parked behind dead letter %d (offset 3)", dead[3].id)) {
		t.Fatalf("retry of K-4 = %+v, %v; want it refused, naming K-3's letter", marks, err)
	}
	execSQL(t, b, `UPDATE kfn.dead_letters SET retry_requested_at = now() WHERE id = $1`, dead[4].id)
	execSQL(t, b, `SELECT pg_notify($1, $2)`, inbox.RetryNotifyChannel, b.fn)
	waitFor(t, 30*time.Second, "the lane to hold K-4 back", func() bool {
		return countWhere(t, b, `SELECT count(*) FROM kfn.audit_log WHERE consumer = $1 AND action = $2 AND (details->>'dead_letter_id')::bigint = $3
		   AND details->>'error' LIKE '%parked behind the dead letter at offset 3%'`, inbox.ActionRetryFailed, dead[4].id) == 1
	})
	if l := letters(t, b, 0)[4]; l.marked || l.reason != inbox.ReasonKeyParked {
		t.Errorf("K-4's letter after it was held back = %+v; want it parked, unmarked", l)
	}
	wantKeyOrder(t, b, 0, "K", []int64{0, 1, 2})

	broken.Delete("K-3")
	if _, outcomes := retryIDs(t, b, dead[3].id); outcomes[0].Outcome != inbox.RetryApplied {
		t.Fatalf("retry of the new blocker: %+v; want applied", outcomes)
	}
	waitFor(t, 30*time.Second, "K's parked records applied", func() bool { return len(letters(t, b, 0)) == 0 })
	stop()

	b.check(t, b.fn, produced)
	wantKeyOrder(t, b, 0, "K", []int64{0, 1, 2, 3, 4, 6})
	wantKeyOrder(t, b, 0, "J", []int64{5, 7})
}

// ParkKey works the same with a BatchHandler: the failing batch goes on
// record by record, the culprit blocks its key, and the retry releases it.
func TestParkKeyWithABatchHandler(t *testing.T) {
	b := setup(t, 1)
	var broken sync.Map
	broken.Store("K-1", true)
	fn := effects.BatchFunction(b.fn, b.topic)
	fn.KeyOrder = runtime.ParkKey
	apply := fn.BatchHandler
	fn.BatchHandler = func(ctx context.Context, tx pgx.Tx, recs []runtime.Record, out *runtime.BatchEvents) error {
		for _, rec := range recs {
			if _, bad := broken.Load(string(rec.Value)); bad {
				return runtime.Permanent(errors.New("broken: " + string(rec.Value)))
			}
		}
		return apply(ctx, tx, recs, out)
	}
	_, stop := b.run(t, fn)
	produced := b.produceKeyed(t, 0,
		keyed{"K", "K-0"}, keyed{"J", "J-0"}, keyed{"K", "K-1"}, keyed{"J", "J-1"}, keyed{"K", "K-2"}, keyed{"K", "K-3"}, keyed{"J", "J-2"})
	b.waitCaughtUp(t, b.fn)
	dead := letters(t, b, 0)
	if len(dead) != 3 || dead[2].reason != "permanent" || dead[4].reason != inbox.ReasonKeyParked || dead[5].reason != inbox.ReasonKeyParked {
		t.Fatalf("dead letters = %+v; want 2 permanent, 4 and 5 parked behind it", dead)
	}
	wantKeyOrder(t, b, 0, "J", []int64{1, 3, 6})
	broken.Delete("K-1")
	if _, outcomes := retryIDs(t, b, dead[2].id); outcomes[0].Outcome != inbox.RetryApplied {
		t.Fatalf("retry of the blocker: %+v; want applied", outcomes)
	}
	waitFor(t, 30*time.Second, "K's parked records applied", func() bool { return len(letters(t, b, 0)) == 0 })
	stop()
	b.check(t, b.fn, produced)
	wantKeyOrder(t, b, 0, "K", []int64{0, 2, 4, 5})
}

// KeyOrder is checked when the worker starts: ParkKey is for
// Kafka-triggered functions, and only Continue and ParkKey exist.
func TestKeyOrderIsValidated(t *testing.T) {
	b := setup(t, 1)
	handler := func(context.Context, pgx.Tx, runtime.Record, *runtime.Events) error { return nil }
	for _, tc := range []struct {
		fn   runtime.Function
		want string
	}{
		{runtime.Function{Name: "f", Subject: "s.>", KeyOrder: runtime.ParkKey, Handler: handler}, "function f: KeyOrder ParkKey is supported for Kafka-triggered functions (Topic) only"},
		{runtime.Function{Name: "f", Topic: b.topic, KeyOrder: 7, Handler: handler}, "function f: KeyOrder KeyOrder(7) is neither Continue nor ParkKey"},
	} {
		if _, err := worker.New(context.Background(), b.cfg, tc.fn); err == nil || err.Error() != tc.want {
			t.Errorf("worker.New(%+v) = %v; want %q", tc.fn.KeyOrder, err, tc.want)
		}
	}
}
