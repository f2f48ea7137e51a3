package runtime

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PartitionStatus is what `kfn status` shows for one partition of one function.
type PartitionStatus struct {
	Function      string    `json:"function"`
	Topic         string    `json:"topic"`
	Partition     int32     `json:"partition"`
	Owner         string    `json:"owner"`
	Epoch         int64     `json:"epoch"`
	Cursor        int64     `json:"cursor"`
	HighWater     int64     `json:"high_water"`
	KafkaHighMark int64     `json:"kafka_high_watermark"` // -1 when Kafka could not be asked
	Lag           int64     `json:"lag"`                  // -1 when unknown
	LastCommit    time.Time `json:"last_commit"`
	LastCommitAge string    `json:"last_commit_age"`
}

// Status reads every cursor (of one function, or all when function is empty)
// from Postgres and the partitions' high watermarks from Kafka. When Kafka
// cannot be reached the Postgres side is still returned, with the error.
func Status(ctx context.Context, pool *pgxpool.Pool, brokers []string, function string) ([]PartitionStatus, error) {
	rows, err := pool.Query(ctx, `
SELECT consumer, topic, partition, owner, epoch, next_offset, high_water, updated_at
  FROM kfn.cursors WHERE consumer = $1 OR $1 = '' ORDER BY consumer, topic, partition`, function)
	if err != nil {
		return nil, fmt.Errorf("read cursors: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (PartitionStatus, error) {
		var s PartitionStatus
		err := r.Scan(&s.Function, &s.Topic, &s.Partition, &s.Owner, &s.Epoch, &s.Cursor, &s.HighWater, &s.LastCommit)
		s.KafkaHighMark, s.Lag = -1, -1
		s.LastCommitAge = time.Since(s.LastCommit).Round(time.Second).String()
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("read cursors: %w", err)
	}
	if len(brokers) == 0 {
		return out, nil
	}
	src := newKafkaSource(brokers, slog.New(slog.DiscardHandler))
	for i := range out {
		s := &out[i]
		_, high, err := src.offsetRange(ctx, s.Topic, s.Partition)
		if err != nil {
			return out, fmt.Errorf("cannot read high watermarks from Kafka at %v: %w", brokers, err)
		}
		s.KafkaHighMark = high
		s.Lag = max(0, high-s.Cursor)
	}
	return out, nil
}
