package schema_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// fenceAndClaimSchema11 is the batch's fence and inbox claim as workers
// built for schema 11 ran it, on the inbox keyed by (consumer, topic,
// partition, offset): the baseline of BenchmarkInboxKey.
const fenceAndClaimSchema11 = `
WITH fence AS (
  UPDATE kfn.cursors
     SET next_offset = $6, high_water = greatest(high_water, $6), updated_at = now()
   WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch = $4 AND next_offset = $5
  RETURNING 1
), taken AS (
  SELECT NOT $8::boolean OR EXISTS (
    SELECT FROM kfn.inbox
     WHERE consumer = $1 AND topic = $2 AND partition = $3
       AND "offset" BETWEEN (SELECT min(o) FROM unnest($7::bigint[]) AS o) AND (SELECT max(o) FROM unnest($7::bigint[]) AS o)) AS held
), plain AS (
  INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch, outcome)
  SELECT $1, $2, $3, o, $4, 'applied' FROM unnest($7::bigint[]) AS o
   WHERE EXISTS (SELECT FROM fence) AND NOT (SELECT held FROM taken)
), claim AS (
  INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch, outcome)
  SELECT $1, $2, $3, o, $4, 'applied' FROM unnest($7::bigint[]) AS o
   WHERE EXISTS (SELECT FROM fence) AND (SELECT held FROM taken)
  ON CONFLICT DO NOTHING
  RETURNING "offset"
)
SELECT (SELECT count(*) FROM fence), (SELECT held FROM taken),
       coalesce((SELECT array_agg("offset" ORDER BY "offset") FROM claim), '{}')`

// BenchmarkInboxKey measures a batch's fence and inbox claim (500
// records, the bench's batch size, round robin over 4 partitions) on the
// inbox of schema 11 and on the compact key of schema 12, in the same run
// on the same server, for short names (function and topic "orders") and
// for the names kfn bench gives (29 characters each). It reports the time
// of the statement (the COMMIT is not timed: its WAL flush is the disk's),
// and per row the WAL, the heap and the primary key's bytes.
//
//	go test ./internal/schema -run '^$' -bench BenchmarkInboxKey -benchtime 400x -count 3
func BenchmarkInboxKey(b *testing.B) {
	names := []struct{ name, consumer, topic string }{
		{"short names", "orders", "orders"},
		{"bench names", "orders-eo-1796161972417128103", "kfn-bench-1796161972417128103"},
	}
	for _, n := range names {
		for _, layout := range []string{"schema 11", "compact"} {
			b.Run(n.name+"/"+layout, func(b *testing.B) {
				db := kfntest.PostgresEmpty(b)
				ctx := context.Background()
				version := schema.Latest()
				if layout == "schema 11" {
					version = 11
				}
				if _, err := schema.MigrateTo(ctx, db.Pool, version); err != nil {
					b.Fatal(err)
				}
				benchClaims(b, db.Pool, layout == "schema 11", n.consumer, n.topic)
			})
		}
	}
}

func benchClaims(b *testing.B, pool *pgxpool.Pool, schema11 bool, consumer, topic string) {
	ctx := context.Background()
	const partitions, batch = 4, 500
	next := make([]int64, partitions)
	for p := range int32(partitions) {
		// ClaimPartition adds the lane at schema 12; at 11 the cursor alone.
		_, err := pool.Exec(ctx, `INSERT INTO kfn.cursors (consumer, topic, partition, next_offset, high_water, epoch, owner) VALUES ($1, $2, $3, 0, 0, 1, 'bench')`, consumer, topic, p)
		if err == nil && !schema11 {
			err = inbox.AddLane(ctx, pool, inbox.Partition{Consumer: consumer, Topic: topic, Partition: p})
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	var walBefore int64
	if err := pool.QueryRow(ctx, `SELECT pg_current_wal_lsn() - '0/0'`).Scan(&walBefore); err != nil {
		b.Fatal(err)
	}
	var claimed time.Duration
	b.ResetTimer()
	b.StopTimer()
	for i := range b.N {
		p := int32(i % partitions)
		offsets := make([]int64, batch)
		for j := range offsets {
			offsets[j] = next[p] + int64(j)
		}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			b.StartTimer()
			start := time.Now()
			var err error
			if schema11 {
				var moved int64
				var taken bool
				var fresh []int64
				err = tx.QueryRow(ctx, fenceAndClaimSchema11, consumer, topic, p, int64(1), next[p], next[p]+batch, offsets, true).Scan(&moved, &taken, &fresh)
				if err == nil && (moved != 1 || taken) {
					err = fmt.Errorf("moved %d, taken %v", moved, taken)
				}
			} else {
				bt := &pgx.Batch{}
				result := inbox.QueueFenceAndClaim(bt, inbox.Partition{Consumer: consumer, Topic: topic, Partition: p}, 1, next[p], next[p]+batch, offsets)
				if err = tx.SendBatch(ctx, bt).Close(); err == nil {
					var fresh []int64
					if fresh, err = result(ctx, tx); err == nil && len(fresh) != batch {
						err = fmt.Errorf("claimed %d of %d", len(fresh), batch)
					}
				}
			}
			claimed += time.Since(start)
			b.StopTimer()
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
		next[p] += batch
	}
	rows := float64(b.N * batch)
	var wal, heap, index int64
	err := pool.QueryRow(ctx, `SELECT pg_current_wal_lsn() - '0/0' - $1, pg_relation_size('kfn.inbox'), pg_relation_size('kfn.inbox_pkey')`, walBefore).Scan(&wal, &heap, &index)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(claimed.Microseconds())/float64(b.N), "µs/claim")
	b.ReportMetric(float64(claimed.Nanoseconds())/rows, "ns/record")
	b.ReportMetric(float64(wal)/rows, "WAL-B/record")
	b.ReportMetric(float64(heap)/rows, "heap-B/record")
	b.ReportMetric(float64(index)/rows, "pkey-B/record")
}

// BenchmarkMigration12 measures migration 0012 on an inbox of schema 11
// holding a million rows (2 functions × 4 partitions, bench names), both
// ways. Offline, as on a database migrated without the online copy: the
// move of every row to the compact key in the migration's transaction,
// which is how long the workers stand still. Online, as kfn migrate does
// it on an installation at schema 11, with no worker running, and while a
// worker built for schema 11 claims batches of 500 records on a partition
// of its own, 20 batches a second (10,000 records/s): Migrate's whole
// time, the copy's, the swap's (how long the workers stand still, besides
// their restart), and that worker's claims, before the migration and
// during the copy (median), and the longest while Migrate prepared.
//
//	go test ./internal/schema -run '^$' -bench BenchmarkMigration12 -benchtime 1x
func BenchmarkMigration12(b *testing.B) {
	const rows = 1_000_000
	fill := `INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch)
SELECT 'orders-eo-179616197241712810' || i % 2, 'kfn-bench-1796161972417128103', i / 2 % 4, i / 8, 1 FROM generate_series(0, $1 - 1) AS i`
	b.Run("offline", func(b *testing.B) { benchMigration(b, 12, rows, fill, schema.MigrateToOffline) })
	b.Run("online/no worker", func(b *testing.B) { benchMigration12Online(b, rows, fill, 0) })
	b.Run("online/a worker at 10k records per s", func(b *testing.B) { benchMigration12Online(b, rows, fill, 20) })
}

// benchMigration measures migration version, applied by migrate, on a
// database of the version before that fill (given the row count as $1)
// has filled with rows rows, as rows/s of the migration's own time.
func benchMigration(b *testing.B, version, rows int, fill string, migrate func(context.Context, *pgxpool.Pool, int) ([]int, error)) {
	ctx := context.Background()
	var moved time.Duration
	for range b.N {
		b.StopTimer()
		db := kfntest.PostgresEmpty(b)
		if _, err := schema.MigrateTo(ctx, db.Pool, version-1); err != nil {
			b.Fatal(err)
		}
		if _, err := db.Pool.Exec(ctx, fill, rows); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		start := time.Now()
		if _, err := migrate(ctx, db.Pool, version); err != nil {
			b.Fatal(err)
		}
		moved += time.Since(start)
	}
	b.ReportMetric(float64(rows*b.N)/moved.Seconds(), "rows/s")
	b.ReportMetric(moved.Seconds()/float64(b.N), "s/migration")
}

// benchMigration12Online is BenchmarkMigration12's online way, with a
// worker of schema 11 claiming batches claims/s batches a second (none
// with 0).
func benchMigration12Online(b *testing.B, rows int, fill string, claims int) {
	ctx := context.Background()
	var total, copying, swap, before, during, longest time.Duration
	for range b.N {
		b.StopTimer()
		db := kfntest.PostgresEmpty(b)
		if _, err := schema.MigrateTo(ctx, db.Pool, 11); err != nil {
			b.Fatal(err)
		}
		if _, err := db.Pool.Exec(ctx, fill, rows); err != nil {
			b.Fatal(err)
		}
		if _, err := db.Pool.Exec(ctx, `ANALYZE kfn.inbox`); err != nil {
			b.Fatal(err)
		}
		w := benchWriter{pool: db.Pool}
		stop, stopped := make(chan struct{}), make(chan struct{})
		if claims > 0 {
			go func() { defer close(stopped); w.run(ctx, stop, time.Second/time.Duration(claims)) }()
			time.Sleep(2 * time.Second) // its pace before the migration
		} else {
			close(stopped)
		}
		b.StartTimer()
		start := time.Now()
		var copyStart, copyEnd, swapStart time.Time
		_, err := schema.MigrateReporting(ctx, db.Pool, func(p schema.Progress) {
			switch p.Step {
			case schema.StepMirroring:
				copyStart = time.Now()
			case schema.StepCopied:
				copyEnd = time.Now()
			case schema.StepSwapping:
				swapStart = time.Now()
			case schema.StepSwapped:
				swap += p.Elapsed
			}
		})
		total += time.Since(start)
		b.StopTimer()
		close(stop)
		<-stopped
		if err != nil {
			b.Fatal(err)
		}
		if w.err != nil && w.failed.Before(swapStart) {
			b.Fatalf("the worker of schema 11 failed before the swap: %v", w.err)
		}
		copying += copyEnd.Sub(copyStart)
		b1, d, l := w.claims(start, copyStart, copyEnd, swapStart)
		before, during, longest = before+b1, during+d, max(longest, l)
	}
	if claims == 0 {
		b.ReportMetric((total / time.Duration(b.N)).Seconds(), "s/migration")
		b.ReportMetric((copying / time.Duration(b.N)).Seconds(), "s/copy")
		b.ReportMetric(float64(rows*b.N)/copying.Seconds(), "copied-rows/s")
		b.ReportMetric(float64((swap/time.Duration(b.N)).Microseconds())/1e3, "ms/swap")
		return
	}
	n := time.Duration(b.N)
	b.ReportMetric((total / n).Seconds(), "s/migration")
	b.ReportMetric((copying / n).Seconds(), "s/copy")
	b.ReportMetric(float64(rows*b.N)/copying.Seconds(), "copied-rows/s")
	b.ReportMetric(float64((swap/n).Microseconds())/1e3, "ms/swap")
	b.ReportMetric(float64((before/n).Microseconds())/1e3, "ms/claim-before")
	b.ReportMetric(float64((during/n).Microseconds())/1e3, "ms/claim-during-copy")
	b.ReportMetric(float64(longest.Microseconds())/1e3, "ms/longest-claim")
}

// benchWriter claims batches of 500 records with the statement of
// schema 11, one every pace at the most, until stopped or its first error
// (from the swap on: the old table is gone).
type benchWriter struct {
	pool   *pgxpool.Pool
	spans  [][2]time.Time // each committed claim's start and end
	err    error
	failed time.Time
}

func (w *benchWriter) run(ctx context.Context, stop <-chan struct{}, pace time.Duration) {
	const consumer, topic = "orders-eo-schema-11", "kfn-bench-1796161972417128103"
	if _, w.err = w.pool.Exec(ctx, `INSERT INTO kfn.cursors (consumer, topic, partition, next_offset, high_water, epoch, owner) VALUES ($1, $2, 0, 0, 0, 1, 'bench')`, consumer, topic); w.err != nil {
		w.failed = time.Now()
		return
	}
	offsets := make([]int64, 500)
	tick := time.NewTicker(pace)
	defer tick.Stop()
	for next := int64(0); ; next += 500 {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		for i := range offsets {
			offsets[i] = next + int64(i)
		}
		start := time.Now()
		var moved int64
		var taken bool
		var fresh []int64
		err := w.pool.QueryRow(ctx, fenceAndClaimSchema11, consumer, topic, int32(0), int64(1), next, next+500, offsets, true).Scan(&moved, &taken, &fresh)
		if err == nil && moved != 1 {
			err = fmt.Errorf("moved %d", moved)
		}
		if err != nil {
			w.err, w.failed = err, time.Now()
			return
		}
		w.spans = append(w.spans, [2]time.Time{start, time.Now()})
	}
}

// claims returns the median claim before the migration started, the
// median during the copy, and the longest while Migrate prepared.
func (w *benchWriter) claims(start, copyStart, copyEnd, swapStart time.Time) (before, during, longest time.Duration) {
	var pre, mid []time.Duration
	for _, s := range w.spans {
		d := s[1].Sub(s[0])
		switch {
		case s[1].Before(start):
			pre = append(pre, d)
		case s[0].After(copyStart) && s[1].Before(copyEnd):
			mid = append(mid, d)
		}
		if s[1].After(start) && s[0].Before(swapStart) {
			longest = max(longest, d)
		}
	}
	median := func(ds []time.Duration) time.Duration {
		if len(ds) == 0 {
			return 0
		}
		slices.Sort(ds)
		return ds[len(ds)/2]
	}
	return median(pre), median(mid), longest
}
