package runtime_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime"
)

func TestDeliveringRecordsTwiceAppliesThemOnce(t *testing.T) {
	b := setup(t, 3)
	fn := effects.Function(b.fn, b.topic)
	produced := b.produceN(t, 3, 40)

	w, stop := b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	wantDuplicates(t, w, 0, "the first delivery has nothing to skip")
	b.check(t, b.fn, produced)

	// Redelivery below the high-water mark: the cursor is rewound as a
	// replay would, so every record is read again.
	execSQL(t, b, `UPDATE kfn.cursors SET next_offset = 0 WHERE consumer = $1`, b.fn)
	w, stop = b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	if got := w.Stats().Duplicates.Load(); got != 120 {
		t.Errorf("duplicates skipped by the high-water mark = %d, want 120", got)
	}
	b.check(t, b.fn, produced)

	// Redelivery when only the inbox remembers: the high-water mark is
	// erased too, so the inbox claim is the last guard.
	execSQL(t, b, `UPDATE kfn.cursors SET next_offset = 0, high_water = 0 WHERE consumer = $1`, b.fn)
	w, stop = b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	if got := w.Stats().Duplicates.Load(); got != 120 {
		t.Errorf("duplicates skipped by the inbox = %d, want 120", got)
	}
	if rep := b.check(t, b.fn, produced); rep.Applied != 120 {
		t.Errorf("applied = %d, want 120", rep.Applied)
	}
}

func TestResumesFromPostgresCursorWhenKafkaGroupOffsetIsBehindOrMissing(t *testing.T) {
	b := setup(t, 2)
	fn := effects.Function(b.fn, b.topic)
	produced := b.produceN(t, 2, 30)
	w, stop := b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	wantDuplicates(t, w, 0, "the first run reads every record once")

	client := &kafka.Client{Addr: kafka.TCP(b.kafka.Brokers...)}
	ctx := context.Background()
	// Behind: the group offset of partition 0 goes back to the start.
	_, err := client.OffsetCommit(ctx, &kafka.OffsetCommitRequest{GroupID: b.fn, GenerationID: -1,
		Topics: map[string][]kafka.OffsetCommit{b.topic: {{Partition: 0, Offset: 0}}}})
	if err != nil {
		t.Fatalf("rewind group offset: %v", err)
	}
	produced = append(produced, b.produceN(t, 2, 10)...)
	w, stop = b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	// A worker that resumed from the group offset would read partition 0's
	// 30 records again, and the high-water mark would skip them without a
	// trace in the effects: only the duplicate count shows it.
	wantDuplicates(t, w, 0, "a worker resuming at the Postgres cursor reads nothing twice, whatever the group offset")
	b.check(t, b.fn, produced)

	// Missing: the consumer group is deleted altogether.
	resp, err := client.DeleteGroups(ctx, &kafka.DeleteGroupsRequest{GroupIDs: []string{b.fn}})
	if err != nil {
		t.Fatalf("delete group: %v", err)
	}
	if err := resp.Errors[b.fn]; err != nil {
		t.Fatalf("delete group: %v", err)
	}
	produced = append(produced, b.produceN(t, 2, 10)...)
	w, stop = b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	wantDuplicates(t, w, 0, "a worker resuming at the Postgres cursor reads nothing twice when the group is gone")
	if rep := b.check(t, b.fn, produced); rep.Applied != 100 {
		t.Errorf("applied = %d, want 100", rep.Applied)
	}
}

func TestBadRecordsAreRetriedOrDeadLetteredAndLaterRecordsGoOn(t *testing.T) {
	b := setup(t, 1)
	fn := effects.Function(b.fn, b.topic)
	big := bytes.Repeat([]byte("x"), 1_000_000)
	produced := b.produce(t, 0,
		[]byte("ok-0"),           // 0 applied
		[]byte("fail-2"),         // 1 applied on attempt 3
		[]byte("permanent"),      // 2 dead-lettered at once
		[]byte("panic"),          // 3 dead-lettered after 3 attempts
		[]byte(`{"broken":`),     // 4 malformed JSON: dead-lettered at once
		nil,                      // 5 tombstone: this handler applies it
		big,                      // 6 oversized: dead-lettered, handler never sees it
		[]byte("always"),         // 7 dead-lettered after 3 attempts
		[]byte(`{"fine": true}`), // 8 applied
		[]byte("ok-9"),           // 9 applied
	)
	w, stop := b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	wantDuplicates(t, w, 0, "retries and dead letters are not redeliveries")

	rep := b.check(t, b.fn, produced, offsets(produced, 2, 3, 4, 6, 7)...)
	if rep.Applied != 5 || rep.DeadLetters != 5 {
		t.Errorf("applied=%d dead-lettered=%d, want 5 and 5", rep.Applied, rep.DeadLetters)
	}
	ctx := context.Background()
	rows, err := b.pg.Pool.Query(ctx, `SELECT "offset", attempt FROM `+pgx.Identifier{"effects_" + b.fn}.Sanitize()+` ORDER BY lsn`)
	if err != nil {
		t.Fatal(err)
	}
	type effect struct{ Offset, Attempt int64 }
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[effect])
	if err != nil {
		t.Fatal(err)
	}
	want := []effect{{0, 1}, {1, 3}, {5, 1}, {8, 1}, {9, 1}}
	if len(got) != len(want) {
		t.Fatalf("effects = %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("effect %d = %+v, want %+v (offset order in commit order, attempt)", i, got[i], want[i])
		}
	}

	dead, err := inbox.ListDeadLetters(ctx, b.pg.Pool, b.fn, 100)
	if err != nil {
		t.Fatal(err)
	}
	type dl struct {
		Offset   int64
		Reason   string
		Attempts int
	}
	wantDead := []dl{{2, "permanent", 1}, {3, "panic", 3}, {4, "permanent", 1}, {6, "oversized", 0}, {7, "handler_error", 3}}
	if len(dead) != len(wantDead) {
		t.Fatalf("dead letters = %d, want %d", len(dead), len(wantDead))
	}
	for i, d := range dead {
		if g := (dl{d.Offset, d.Reason, d.Attempts}); g != wantDead[i] {
			t.Errorf("dead letter %d = %+v, want %+v (error %q)", i, g, wantDead[i], d.Error)
		}
		if d.Error == "" {
			t.Errorf("dead letter at offset %d has no error text", d.Offset)
		}
	}
	// An oversized dead letter keeps a 4 KiB prefix, the size and the hash.
	bigSum := sha256.Sum256(big)
	if over := dead[3]; !bytes.Equal(over.Value, big[:4096]) || over.ValueSize != int64(len(big)) || !bytes.Equal(over.ValueSHA256, bigSum[:]) {
		t.Errorf("oversized dead letter kept %d bytes of the value, size %d, sha256 %x; want the first 4096, %d, %x",
			len(over.Value), over.ValueSize, over.ValueSHA256, len(big), bigSum)
	}
	if small := dead[0]; !bytes.Equal(small.Value, []byte("permanent")) || small.ValueSize != 9 || small.ValueSHA256 != nil {
		t.Errorf("dead letter of a small record: value %q size %d sha256 %x; want it whole with size 9 and no hash", small.Value, small.ValueSize, small.ValueSHA256)
	}
	if got := w.Stats().Retries.Load(); got != 6 {
		t.Errorf("retries = %d, want 6 (2 for fail-2, 2 for panic, 2 for always)", got)
	}
	var outcomes map[string]int64
	err = b.pg.Pool.QueryRow(ctx, `SELECT jsonb_object_agg(outcome, n) FROM (SELECT outcome, count(*) n FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = $1 GROUP BY outcome) s`, b.fn).Scan(&outcomes)
	if err != nil {
		t.Fatal(err)
	}
	if outcomes["applied"] != 5 || outcomes["dead_lettered"] != 5 {
		t.Errorf("inbox outcomes = %v, want 5 applied and 5 dead_lettered", outcomes)
	}
}

func TestBatchHandlerFindsTheFailingRecord(t *testing.T) {
	b := setup(t, 1)
	produced := b.produce(t, 0, []byte("a"), []byte("b"), []byte("permanent"), []byte("c"), []byte("d"))
	w, stop := b.run(t, effects.BatchFunction(b.fn, b.topic))
	b.waitCaughtUp(t, b.fn)
	stop()
	wantDuplicates(t, w, 0, "going one record at a time after a batch failure reads nothing twice")
	rep := b.check(t, b.fn, produced, produced[2])
	if rep.Applied != 4 || rep.DeadLetters != 1 {
		t.Errorf("applied=%d dead-lettered=%d, want 4 and 1", rep.Applied, rep.DeadLetters)
	}
}

// TestBatchHandlerRejectsARecordWithoutFailingTheBatch: a record the batch
// handler rejects is dead-lettered (reason permanent) in the batch's own
// transaction, and the other records commit with it: one batch, no
// retries, no going one record at a time.
func TestBatchHandlerRejectsARecordWithoutFailingTheBatch(t *testing.T) {
	b := setup(t, 1)
	produced := b.produce(t, 0, []byte("a"), []byte("b"), []byte("reject"), []byte("c"), []byte("d"))
	fn := effects.BatchFunction(b.fn, b.topic)
	apply := fn.BatchHandler
	fn.BatchHandler = func(ctx context.Context, tx pgx.Tx, recs []runtime.Record, out *runtime.BatchEvents) error {
		var keep []runtime.Record
		for _, r := range recs {
			if string(r.Value) == "reject" {
				out.Emit(r, runtime.Event{Subject: effects.Subject(b.fn), Data: r.Value}) // dropped with the record
				out.Reject(r, errors.New("asked to be rejected"))
				continue
			}
			keep = append(keep, r)
		}
		return apply(ctx, tx, keep, out)
	}
	w, stop := b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	rep := b.check(t, b.fn, produced, produced[2])
	if rep.Applied != 4 || rep.DeadLetters != 1 {
		t.Errorf("applied=%d dead-lettered=%d, want 4 and 1", rep.Applied, rep.DeadLetters)
	}
	st := w.Stats()
	if st.Batches.Load() != 1 || st.Retries.Load() != 0 || st.Applied.Load() != 4 || st.DeadLettered.Load() != 1 {
		t.Errorf("batches %d, retries %d, applied %d, dead-lettered %d; want 1 batch, no retry, 4 applied and 1 dead-lettered",
			st.Batches.Load(), st.Retries.Load(), st.Applied.Load(), st.DeadLettered.Load())
	}
	var reason, errText string
	if err := b.pg.Pool.QueryRow(context.Background(), `SELECT reason, error FROM kfn.dead_letters WHERE consumer = $1`, b.fn).Scan(&reason, &errText); err != nil {
		t.Fatal(err)
	}
	if reason != "permanent" || !strings.Contains(errText, "asked to be rejected") {
		t.Errorf("dead letter: reason %q, error %q; want permanent, with the handler's reason", reason, errText)
	}
}

// TestABatchTakesTwoRoundTripsOfKfnsOwn counts the Postgres round trips of
// a batch transaction whose handler makes one: begin, fence and claim in
// one, the handler's statement, the outbox rows and the commit in one.
func TestABatchTakesTwoRoundTripsOfKfnsOwn(t *testing.T) {
	b := setup(t, 1)
	b.cfg.NoRelay = true
	table := pgx.Identifier{"bulk_" + b.fn}.Sanitize()
	fn := runtime.Function{
		Name: b.fn, Topic: b.topic, Emits: []string{effects.Subject(b.fn)},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` ("offset" bigint PRIMARY KEY)`)
			return err
		},
		BatchHandler: func(ctx context.Context, tx pgx.Tx, recs []runtime.Record, out *runtime.BatchEvents) error {
			offsets := make([]int64, len(recs))
			for i, r := range recs {
				offsets[i] = r.Offset
				out.Emit(r, runtime.Event{Subject: effects.Subject(b.fn), Data: r.Value})
			}
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` SELECT unnest($1::bigint[])`, offsets)
			return err
		},
	}
	w, stop := b.run(t, fn)
	defer stop()
	// The worker counts a batch once it has the COMMIT's reply, which may
	// be after the cursor moved in Postgres: wait for its counters.
	applied := func(n int64) {
		t.Helper()
		waitFor(t, 30*time.Second, fmt.Sprintf("%d records applied", n), func() bool { return w.Stats().Applied.Load() >= n })
	}
	b.produceN(t, 1, 20) // the first batches prepare their statements
	applied(20)
	var perBatch []float64
	for round := 0; round < 5; round++ {
		trips, batches := w.Stats().BatchRoundTrips.Load(), w.Stats().Batches.Load()
		b.produceN(t, 1, 20)
		applied(int64(40 + 20*round))
		dt, db := w.Stats().BatchRoundTrips.Load()-trips, w.Stats().Batches.Load()-batches
		if db == 0 {
			t.Fatalf("round %d: no batch committed", round)
		}
		perBatch = append(perBatch, float64(dt)/float64(db))
	}
	t.Logf("round trips per batch, by round: %v", perBatch)
	sort.Float64s(perBatch)
	if median := perBatch[len(perBatch)/2]; median != 3 {
		t.Errorf("median round trips per batch %.1f, want 3: BEGIN+fence+claim, the handler's INSERT, outbox+COMMIT (%v)", median, perBatch)
	}
}

// TestPipelinedExecsTakeOneRoundTripPerBatchAndChargeTheirRecord: with
// PipelineExecs a per-record handler's Execs go to Postgres together, in
// one round trip per batch; a Query sees the earlier records' writes; a
// statement that fails is charged to the record that queued it, which is
// dead-lettered while the others are applied.
func TestPipelinedExecsTakeOneRoundTripPerBatchAndChargeTheirRecord(t *testing.T) {
	b := setup(t, 1)
	b.cfg.NoRelay = true
	table := pgx.Identifier{"piped_" + b.fn}.Sanitize()
	var sawEarlierWrites atomic.Bool
	fn := runtime.Function{
		Name: b.fn, Topic: b.topic, PipelineExecs: true,
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` ("offset" bigint PRIMARY KEY, value text NOT NULL CHECK (value <> 'bad'))`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			if string(rec.Value) == "count" { // reads what the batch wrote so far
				var n int64
				if err := tx.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE "offset" < $1`, rec.Offset).Scan(&n); err != nil {
					return err
				}
				if n == rec.Offset {
					sawEarlierWrites.Store(true)
				}
			}
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1, $2)`, rec.Offset, string(rec.Value))
			return err
		},
	}
	w, stop := b.run(t, fn)
	defer stop()
	produced := b.produce(t, 0, []byte("a"), []byte("b"), []byte("count"), []byte("c"))
	b.waitCaughtUp(t, b.fn)
	if !sawEarlierWrites.Load() {
		t.Errorf("the handler's query did not see the batch's earlier writes")
	}
	for round := 0; round < 3; round++ {
		trips, batches := w.Stats().BatchRoundTrips.Load(), w.Stats().Batches.Load()
		produced = append(produced, b.produceN(t, 1, 20)...)
		// The worker counts a batch once it has the COMMIT's reply, which
		// may be after the cursor moved in Postgres.
		waitFor(t, 30*time.Second, "the round's records applied", func() bool { return w.Stats().Applied.Load() >= int64(len(produced)) })
		dt, db := w.Stats().BatchRoundTrips.Load()-trips, w.Stats().Batches.Load()-batches
		t.Logf("round %d: %d round trips in %d batches", round, dt, db)
		if db == 0 || dt > 3*db {
			t.Errorf("round %d: %d round trips in %d batches of 20 records; want 3 per batch (the 20 Execs in one)", round, dt, db)
		}
	}
	bad := b.produce(t, 0, []byte("d"), []byte("bad"), []byte("e"))
	produced = append(produced, bad...)
	b.waitCaughtUp(t, b.fn)
	stop()
	var dead int64
	if err := b.pg.Pool.QueryRow(context.Background(), `SELECT "offset" FROM kfn.dead_letters WHERE consumer = $1`, b.fn).Scan(&dead); err != nil || dead != bad[1].Offset {
		t.Errorf("dead letter at offset %d (%v), want the failing record at %d", dead, err, bad[1].Offset)
	}
	var stored int
	if err := b.pg.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+table).Scan(&stored); err != nil || stored != len(produced)-1 {
		t.Errorf("%d rows stored (%v), want %d: every record but the failing one", stored, err, len(produced)-1)
	}
}
