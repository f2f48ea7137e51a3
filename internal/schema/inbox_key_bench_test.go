package schema_test

import (
	"context"
	"fmt"
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
// holding a million rows (2 functions × 4 partitions, bench names): the
// move of every row to the compact key, in the migration's transaction.
//
//	go test ./internal/schema -run '^$' -bench BenchmarkMigration12 -benchtime 1x
func BenchmarkMigration12(b *testing.B) {
	benchMigration(b, 12, 1_000_000, `INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch)
SELECT 'orders-eo-179616197241712810' || i % 2, 'kfn-bench-1796161972417128103', i / 2 % 4, i / 8, 1 FROM generate_series(0, $1 - 1) AS i`)
}

// benchMigration measures migration version on a database of the version
// before that fill (given the row count as $1) has filled with rows rows,
// as rows/s of the migration's own time.
func benchMigration(b *testing.B, version, rows int, fill string) {
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
		if _, err := schema.MigrateTo(ctx, db.Pool, version); err != nil {
			b.Fatal(err)
		}
		moved += time.Since(start)
	}
	b.ReportMetric(float64(rows*b.N)/moved.Seconds(), "rows/s")
}
