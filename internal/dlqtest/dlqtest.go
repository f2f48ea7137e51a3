// Package dlqtest writes dead letters straight into a kfn database, with
// their inbox rows, for the tests of the commands and console pages that
// list dead letters and act on them.
package dlqtest

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/inbox"
)

// Letter is one dead letter to write.
type Letter struct {
	Function, Topic string
	Partition       int32
	Offset          int64
	Reason, Error   string
	// Age is how long ago the record was dead-lettered (0: now).
	Age        time.Duration
	Key, Value []byte
	Headers    []inbox.Header
	// Raw stores the record as one raw blob, as a record too large or too
	// malformed to split into its parts is stored.
	Raw bool
}

// RecordTime is every letter's Kafka record time.
var RecordTime = time.Date(2026, 3, 1, 9, 0, 0, 0, time.UTC)

// Seed writes the letters in order, each in its own transaction (so a
// fresh database numbers them 1, 2, …), and returns their ids.
func Seed(t testing.TB, pool *pgxpool.Pool, letters ...Letter) []int64 {
	t.Helper()
	ctx := context.Background()
	var ids []int64
	for _, l := range letters {
		p := inbox.Partition{Consumer: l.Function, Topic: l.Topic, Partition: l.Partition}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if err := inbox.MarkDeadLettered(ctx, tx, p, 1, l.Offset); err != nil {
				return err
			}
			_, err := inbox.WriteDeadLetter(ctx, tx, inbox.DeadLetter{Partition: p, Offset: l.Offset, Key: l.Key, Value: l.Value, Headers: l.Headers,
				Reason: l.Reason, Error: l.Error, Attempts: 5, StoredRaw: l.Raw, RecordTime: RecordTime})
			if err != nil {
				return err
			}
			var id int64
			err = tx.QueryRow(ctx, `UPDATE kfn.dead_letters SET dead_at = now() - $5::interval
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND "offset" = $4 RETURNING id`, p.Consumer, p.Topic, p.Partition, l.Offset, l.Age).Scan(&id)
			ids = append(ids, id)
			return err
		})
		if err != nil {
			t.Fatalf("seed dead letter %+v: %v", l, err)
		}
	}
	return ids
}
