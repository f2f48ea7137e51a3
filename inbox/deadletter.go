package inbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Header is one Kafka record header.
type Header struct {
	Key   string `json:"key"`
	Value []byte `json:"value"`
}

// DeadLetter is a record that could not be applied, with why.
type DeadLetter struct {
	ID         int64
	Partition  Partition
	Offset     int64
	Key        []byte
	Value      []byte
	Headers    []Header
	RecordTime time.Time
	Reason     string // short machine-friendly cause: handler_error, permanent, panic, oversized, timeout
	Error      string // the full error text
	Attempts   int
	DeadAt     time.Time
}

// WriteDeadLetter parks a record inside tx. The caller also records the
// record in its inbox as dead-lettered (MarkDeadLettered for Kafka records),
// so a replay does not apply it behind the operator's back. A re-execution
// that dead-letters the record again updates the row.
func WriteDeadLetter(ctx context.Context, tx pgx.Tx, d DeadLetter) error {
	headers := d.Headers
	if headers == nil {
		headers = []Header{}
	}
	var recordTime *time.Time
	if !d.RecordTime.IsZero() {
		recordTime = &d.RecordTime
	}
	_, err := tx.Exec(ctx, `
INSERT INTO kfn.dead_letters (consumer, topic, partition, "offset", record_key, value, headers, record_time, reason, error, attempts)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
ON CONFLICT (consumer, topic, partition, "offset") DO UPDATE
   SET reason = EXCLUDED.reason, error = EXCLUDED.error, attempts = EXCLUDED.attempts, dead_at = now()`,
		d.Partition.Consumer, d.Partition.Topic, d.Partition.Partition, d.Offset, d.Key, d.Value, headers, recordTime,
		d.Reason, d.Error, d.Attempts)
	if err != nil {
		return fmt.Errorf("dead-letter %s@%d: %w", d.Partition, d.Offset, err)
	}
	return nil
}

// ListDeadLetters returns the dead letters of a consumer, oldest first.
func ListDeadLetters(ctx context.Context, db Querier, consumer string, limit int) ([]DeadLetter, error) {
	rows, err := db.Query(ctx, `
SELECT id, consumer, topic, partition, "offset", record_key, value, headers, coalesce(record_time, 'epoch'), reason, error, attempts, dead_at
  FROM kfn.dead_letters WHERE consumer = $1 OR $1 = '' ORDER BY id LIMIT $2`, consumer, limit)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadLetter, error) {
		var d DeadLetter
		err := r.Scan(&d.ID, &d.Partition.Consumer, &d.Partition.Topic, &d.Partition.Partition, &d.Offset, &d.Key, &d.Value,
			&d.Headers, &d.RecordTime, &d.Reason, &d.Error, &d.Attempts, &d.DeadAt)
		return d, err
	})
}
