package runtime_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime"
)

// TestRecordsExpiredWhileTheLaneIsBehindAreAudited: Kafka deletes records
// past a lane that is held back (its handler blocked, its reader's buffer
// full); the reader then jumps to the first offset left. The lane
// must audit that range as a skip_expired, exactly as a claim does, skip
// nothing else, and apply every record still there once. With batches of
// one, the jump is before a batch; with batches of 5 gathered for up to a
// second, the records read before the jump and those after it share one.
func TestRecordsExpiredWhileTheLaneIsBehindAreAudited(t *testing.T) {
	for _, c := range []struct {
		name             string
		batch            int
		wait             time.Duration
		before, logStart int
	}{
		{"before a batch", 1, 5 * time.Millisecond, 10, 25},
		{"inside a batch", 5, time.Second, 28, 45},
	} {
		t.Run(c.name, func(t *testing.T) {
			expireBehindTheLane(t, c.batch, c.wait, c.before, c.logStart)
		})
	}
}

// expireBehindTheLane holds a lane at offset 0 with `before` records
// produced, produces 20 more, deletes those below logStart, then lets the
// lane go on.
func expireBehindTheLane(t *testing.T, batch int, wait time.Duration, before, logStart int) {
	b := setup(t, 1)
	// The reader fetches only when the lane asks for more records than it
	// holds: it stops fetching while the lane is held.
	b.cfg.BatchSize, b.cfg.BatchWait = batch, wait
	fn := effects.Function(b.fn, b.topic)
	entered, release := make(chan struct{}), make(chan struct{})
	handler := fn.Handler
	fn.Handler = func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
		if rec.Offset == 0 {
			close(entered)
			<-release
		}
		return handler(ctx, tx, rec, out)
	}
	first := b.produceN(t, 1, before) // read in one fetch: the reader stops inside it
	_, stop := b.run(t, fn)
	defer stop()
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the handler never got offset 0")
	}
	later := b.produceN(t, 1, 20) // not fetched yet
	deleteRecords(t, b, int64(logStart))
	close(release)
	b.waitCaughtUp(t, b.fn)
	stop()

	var skips []string
	rows, err := b.pg.Pool.Query(context.Background(), `SELECT details->>'from', details->>'to' FROM kfn.audit_log
WHERE action = 'skip_expired' AND consumer = $1 ORDER BY id`, b.fn)
	if err != nil {
		t.Fatal(err)
	}
	skipped := map[int64]bool{}
	var from, to string
	if _, err := pgx.ForEachRow(rows, []any{&from, &to}, func() error {
		skips = append(skips, from+"-"+to)
		f, _ := strconv.ParseInt(from, 10, 64)
		e, _ := strconv.ParseInt(to, 10, 64)
		for o := f; o < e; o++ {
			skipped[o] = true
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("skip_expired rows: %v", skips)
	if len(skips) == 0 {
		t.Fatal("no skip_expired audit row: the expired records were passed over silently")
	}
	// Records read before the deletion may still be applied; each of the
	// others below the log start is audited, and nothing at or above it.
	var applied []effects.Produced
	for _, p := range append(first, later...) {
		switch {
		case skipped[p.Offset] && p.Offset >= int64(logStart):
			t.Errorf("offset %d is still in Kafka but was skipped as expired", p.Offset)
		case !skipped[p.Offset]:
			applied = append(applied, p)
		}
	}
	if len(applied)+len(skipped) != before+20 {
		t.Errorf("%d applied + %d skipped, want %d records in all", len(applied), len(skipped), before+20)
	}
	b.check(t, b.fn, applied)
}

// TestRecordsExpiredBeforeTheClaimAreAudited: a partition whose records
// below 5 were deleted while no worker ran is claimed with its cursor at
// 0; the claim skips [0, 5) through the same path.
func TestRecordsExpiredBeforeTheClaimAreAudited(t *testing.T) {
	b := setup(t, 1)
	fn := effects.Function(b.fn, b.topic)
	_, stop := b.run(t, fn) // the empty partition's cursor: 0
	b.waitCaughtUp(t, b.fn)
	stop()
	produced := b.produceN(t, 1, 10)
	deleteRecords(t, b, 5)
	_, stop = b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	var skips []string
	rows, err := b.pg.Pool.Query(context.Background(), `SELECT details->>'from' || '-' || (details->>'to') FROM kfn.audit_log
WHERE action = 'skip_expired' AND consumer = $1 ORDER BY id`, b.fn)
	if err != nil {
		t.Fatal(err)
	}
	if skips, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if len(skips) != 1 || skips[0] != "0-5" {
		t.Errorf("skip_expired rows %v, want [0-5]", skips)
	}
	b.check(t, b.fn, produced[5:])
}

// deleteRecords deletes the records of partition 0 of the bundle's topic
// below offset before, as retention would (kafka-go has no DeleteRecords).
func deleteRecords(t *testing.T, b *bundle, before int64) {
	t.Helper()
	client, err := kgo.NewClient(kgo.SeedBrokers(b.kafka.Brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	part := kmsg.NewDeleteRecordsRequestTopicPartition()
	part.Partition, part.Offset = 0, before
	topic := kmsg.NewDeleteRecordsRequestTopic()
	topic.Topic, topic.Partitions = b.topic, []kmsg.DeleteRecordsRequestTopicPartition{part}
	req := kmsg.NewPtrDeleteRecordsRequest()
	req.Topics, req.TimeoutMillis = []kmsg.DeleteRecordsRequestTopic{topic}, 10000
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	resp, err := req.RequestWith(ctx, client)
	if err != nil {
		t.Fatalf("delete records: %v", err)
	}
	for _, tp := range resp.Topics {
		for _, p := range tp.Partitions {
			if p.ErrorCode != 0 || p.LowWatermark != before {
				t.Fatalf("delete records of %s/%d below %d: error code %d, low watermark %d", tp.Topic, p.Partition, before, p.ErrorCode, p.LowWatermark)
			}
		}
	}
	t.Logf("deleted the records of %s/0 below %d", b.topic, before)
}
