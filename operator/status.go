package operator

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/runtime/lease"
)

// PartitionStatus is what `kfn status` shows for one partition of one function.
type PartitionStatus struct {
	Function      string    `json:"function"`
	Topic         string    `json:"topic"`
	Partition     int32     `json:"partition"`
	Owner         string    `json:"owner"`        // the worker that last claimed it in Postgres
	LeaseHolder   string    `json:"lease_holder"` // who holds its NATS lease now ("" when free or unknown)
	LeaseToken    uint64    `json:"lease_token"`
	Epoch         int64     `json:"epoch"`
	Cursor        int64     `json:"cursor"`
	HighWater     int64     `json:"high_water"`
	KafkaHighMark int64     `json:"kafka_high_watermark"` // -1 when Kafka could not be asked
	Lag           int64     `json:"lag"`                  // -1 when unknown
	LastCommit    time.Time `json:"last_commit"`
	LastCommitAge string    `json:"last_commit_age"`
}

// Status reads every cursor (of one function, or all when function is empty)
// from Postgres, the lease holders from NATS (when js is not nil) and the
// partitions' high watermarks from Kafka (when brokers are given). When NATS
// or Kafka cannot be asked, the Postgres side is still returned, with the
// error.
func Status(ctx context.Context, pool *pgxpool.Pool, brokers []string, js jetstream.JetStream, leaseBucket, function string) ([]PartitionStatus, error) {
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
	if js != nil {
		store, err := lease.OpenExisting(ctx, js, leaseBucket, slog.New(slog.DiscardHandler))
		if err != nil {
			return out, fmt.Errorf("read leases from NATS: %w", err)
		}
		installation, err := engine.InstallationID(ctx, pool)
		if err != nil {
			return out, err
		}
		for i := range out {
			s := &out[i]
			h, err := store.Holder(ctx, engine.LeaseGroup(installation, s.Function, s.Topic), engine.LeaseItem(s.Partition))
			if err != nil && !errors.Is(err, lease.ErrNotHeld) {
				return out, fmt.Errorf("read leases from NATS: %w", err)
			}
			s.LeaseHolder, s.LeaseToken = h.Owner, h.Token
		}
	}
	if len(brokers) == 0 {
		return out, nil
	}
	for i := range out {
		s := &out[i]
		_, high, err := engine.OffsetRange(ctx, brokers, s.Topic, s.Partition)
		if err != nil {
			return out, fmt.Errorf("cannot read high watermarks from Kafka at %v: %w", brokers, err)
		}
		s.KafkaHighMark = high
		s.Lag = max(0, high-s.Cursor)
	}
	return out, nil
}
