package operator

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/kafkasource"
	"github.com/kfn-dev/kfn/runtime"
)

// ParkRequest asks to dead-letter one record of a partition by hand: the
// escape hatch for a record that keeps a lane from moving for a reason no
// one foresaw.
type ParkRequest struct {
	Function  string
	Topic     string
	Partition int32
	Offset    int64
	Reason    string // required, for the audit log
	Actor     string
	// KafkaBrokers, when set, are used to read the record so that its dead
	// letter holds its key, value and headers. Without them, or when the
	// record cannot be read, the dead letter holds only its coordinates.
	KafkaBrokers []string
	// KafkaSecurity is how to connect to KafkaBrokers (TLS, SASL).
	KafkaSecurity runtime.KafkaSecurity
	// LeaseBucket is the workers' --lease-bucket; default lease.DefaultBucket.
	LeaseBucket string
}

// ParkResult says what Park did.
type ParkResult struct {
	inbox.ParkResult
	RecordRead bool  // the dead letter holds the record's bytes
	ReadError  error // why the record could not be read, if it was not
}

// Park moves one unhandled record to the dead letters through the same
// lease-and-fence path as Replay, audited. The lane that owns the
// partition is fenced, takes the partition again and skips the record.
func Park(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, req ParkRequest) (ParkResult, error) {
	if req.Reason == "" {
		return ParkResult{}, errors.New("parking a record needs a reason for the audit log")
	}
	part := inbox.Partition{Consumer: req.Function, Topic: req.Topic, Partition: req.Partition}
	var res ParkResult
	var record *inbox.DeadLetter
	if len(req.KafkaBrokers) > 0 {
		record, res.ReadError = readRecord(ctx, req.KafkaBrokers, req.KafkaSecurity, part, req.Offset)
		res.RecordRead = res.ReadError == nil
	}
	err := withSeizedPartition(ctx, pool, js, req.LeaseBucket, part, req.Actor, func(tx pgx.Tx, token int64) (err error) {
		res.ParkResult, err = inbox.Park(ctx, tx, inbox.ParkRequest{
			Partition: part, Token: token, Offset: req.Offset, Record: record, Actor: req.Actor, Reason: req.Reason,
		})
		return err
	})
	return res, err
}

// readRecord reads the record at offset from Kafka, for its dead letter.
func readRecord(ctx context.Context, brokers []string, security runtime.KafkaSecurity, part inbox.Partition, offset int64) (*inbox.DeadLetter, error) {
	rec, err := kafkasource.ReadRecord(ctx, brokers, security, part.Topic, part.Partition, offset)
	if err != nil {
		return nil, err
	}
	return &inbox.DeadLetter{Key: rec.Key, Value: rec.Value, Headers: inbox.HeadersOf(rec.Headers), RecordTime: rec.Time}, nil
}
