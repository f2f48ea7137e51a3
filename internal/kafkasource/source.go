package kafkasource

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/kafkaconn"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// Source reads a topic's partitions at explicit offsets. It never uses
// Kafka's group coordination for ownership; NATS leases decide who reads what.
type Source struct {
	brokers   []string
	security  kfn.KafkaSecurity
	client    *kafka.Client
	transport *kafka.Transport
	dialer    *kafka.Dialer // the readers'
	log       *slog.Logger

	// FetchBytes bounds a fetch response of its readers (Reader), which
	// a reader holds twice at most, as it arrives and as its records;
	// zero or more than MaxFetchBytes is MaxFetchBytes. Set it before the
	// first Reader.
	FetchBytes int
	// BatchRecords is how many records a lane takes in a batch: a reader
	// fetches about two batches ahead (sizeFetch). Zero: it fetches up to
	// FetchBytes.
	BatchRecords int
}

// New connects with security's TLS and SASL (plain TCP when zero).
func New(brokers []string, security kfn.KafkaSecurity, log *slog.Logger) (*Source, error) {
	transport, dialer, err := kafkaconn.Kafka(security)
	if err != nil {
		return nil, err
	}
	return &Source{
		brokers:   brokers,
		security:  security,
		client:    &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second, Transport: transport},
		transport: transport,
		dialer:    dialer,
		log:       log,
	}, nil
}

// close closes the idle connections of the source's client.
func (k *Source) Close() { k.transport.CloseIdleConnections() }

// ErrTopicMissing means Kafka does not know the topic (yet).
var ErrTopicMissing = errors.New("topic does not exist")

// partitions lists the topic's partition ids.
func (k *Source) Partitions(ctx context.Context, topic string) ([]int32, error) {
	md, err := k.client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return nil, fmt.Errorf("read metadata of topic %s from %v: %w", topic, k.brokers, kafkaconn.Explain(err, k.brokers, k.security))
	}
	for _, t := range md.Topics {
		if t.Name != topic {
			continue
		}
		if t.Error != nil {
			if errors.Is(t.Error, kafka.UnknownTopicOrPartition) {
				return nil, fmt.Errorf("%w: %s", ErrTopicMissing, topic)
			}
			return nil, fmt.Errorf("read metadata of topic %s: %w", topic, t.Error)
		}
		ids := make([]int32, 0, len(t.Partitions))
		for _, p := range t.Partitions {
			ids = append(ids, int32(p.ID))
		}
		sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
		return ids, nil
	}
	return nil, fmt.Errorf("%w: %s", ErrTopicMissing, topic)
}

// OffsetRange returns the first available offset and the high watermark
// (the offset the next produced record will get) of a partition. It asks
// first over the client's pooled connections, in one round trip
// (pooledOffsetRange), as every lane of a starting worker does at once.
// When that fails it asks the partition's leader as a broker names it now,
// on a connection of its own, as kafka-go's readers do: the client's
// transport routes by metadata it refreshes only on a timer (MetadataTTL),
// not when a request fails, so right after a leader change it may ask a
// broker that is gone (an error at once) or no longer leads (an error
// code), and a claim would otherwise wait up to MetadataTTL longer than
// Kafka's failover.
func (k *Source) OffsetRange(ctx context.Context, topic string, partition int32) (first, high int64, err error) {
	ctx, cancel := context.WithTimeout(ctx, offsetRangeTimeout)
	defer cancel()
	if first, high, err = k.pooledOffsetRange(ctx, topic, partition); err == nil {
		return first, high, nil
	}
	errs := []error{err}
	for _, broker := range k.brokers {
		if first, high, err = k.leaderOffsets(ctx, broker, topic, partition); err == nil {
			return first, high, nil
		}
		errs = append(errs, err)
	}
	return 0, 0, fmt.Errorf("list offsets of %s/%d: %w", topic, partition, kafkaconn.Explain(errors.Join(errs...), k.brokers, k.security))
}

// pooledOffsetTimeout bounds pooledOffsetRange: a leader that its cached
// metadata names and that stopped answering (frozen) costs this much
// before OffsetRange asks a fresh connection.
const pooledOffsetTimeout = 500 * time.Millisecond

// pooledOffsetRange asks for a partition's first offset and high watermark
// in one ListOffsets request (kafka-go sends the two queries side by side)
// over the client's connections, routed by its cached metadata: no dial,
// no metadata request, unlike leaderOffsets.
func (k *Source) pooledOffsetRange(ctx context.Context, topic string, partition int32) (first, high int64, err error) {
	ctx, cancel := context.WithTimeout(ctx, pooledOffsetTimeout)
	defer cancel()
	res, err := k.client.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{
		topic: {kafka.FirstOffsetOf(int(partition)), kafka.LastOffsetOf(int(partition))},
	}})
	if err != nil {
		return 0, 0, err
	}
	for _, p := range res.Topics[topic] {
		if p.Partition != int(partition) {
			continue
		}
		if p.Error != nil {
			return 0, 0, p.Error
		}
		if p.FirstOffset < 0 || p.LastOffset < p.FirstOffset {
			return 0, 0, fmt.Errorf("list offsets of %s/%d: the answer holds first %d, high %d", topic, partition, p.FirstOffset, p.LastOffset)
		}
		return p.FirstOffset, p.LastOffset, nil
	}
	return 0, 0, fmt.Errorf("list offsets of %s/%d: no answer for the partition", topic, partition)
}

// offsetRangeTimeout bounds offsetRange, like the client's Timeout.
const offsetRangeTimeout = 10 * time.Second

// leaderOffsets asks broker who leads the partition, then the leader for
// the partition's offsets.
func (k *Source) leaderOffsets(ctx context.Context, broker, topic string, partition int32) (first, high int64, err error) {
	conn, err := k.dialer.DialLeader(ctx, "tcp", broker, topic, int(partition))
	if err != nil {
		return 0, 0, err
	}
	defer conn.Close()
	deadline, _ := ctx.Deadline()
	if err := conn.SetDeadline(deadline); err != nil {
		return 0, 0, err
	}
	return conn.ReadOffsets()
}

// ping asks a broker for its API versions: a round trip to the cluster.
// partitions cannot tell whether Kafka answers: kafka-go's transport
// serves Metadata from a cache it refreshes every few seconds in the
// background, and keeps serving it when a refresh fails.
func (k *Source) Ping(ctx context.Context) error {
	resp, err := k.client.ApiVersions(ctx, &kafka.ApiVersionsRequest{})
	if err == nil {
		err = resp.Error
	}
	if err != nil {
		return fmt.Errorf("brokers %v do not answer: %w", k.brokers, kafkaconn.Explain(err, k.brokers, k.security))
	}
	return nil
}

// OffsetRange returns the first offset Kafka still holds in a partition and
// its high watermark, for the operator's tools.
func OffsetRange(ctx context.Context, brokers []string, security kfn.KafkaSecurity, topic string, partition int32) (first, high int64, err error) {
	source, err := New(brokers, security, slog.New(slog.DiscardHandler))
	if err != nil {
		return 0, 0, err
	}
	defer source.Close()
	return source.OffsetRange(ctx, topic, partition)
}

// ReadRecord reads the record at offset from Kafka, for the operator's
// tools: an offset Kafka no longer (or not yet) holds is an error.
func ReadRecord(ctx context.Context, brokers []string, security kfn.KafkaSecurity, topic string, partition int32, offset int64) (kfn.Record, error) {
	source, err := New(brokers, security, slog.New(slog.DiscardHandler))
	if err != nil {
		return kfn.Record{}, err
	}
	defer source.Close()
	first, high, err := source.OffsetRange(ctx, topic, partition)
	if err != nil {
		return kfn.Record{}, err
	}
	if offset < first || offset >= high {
		return kfn.Record{}, fmt.Errorf("offset %d is outside the records Kafka holds for %s/%d [%d, %d)", offset, topic, partition, first, high)
	}
	reader, err := source.Reader(topic, partition, offset)
	if err != nil {
		return kfn.Record{}, err
	}
	defer reader.Close()
	readCtx, cancel := context.WithTimeout(ctx, readRecordTimeout)
	defer cancel()
	for reader.next <= offset {
		got, err := reader.fetchResponse(readCtx)
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			return kfn.Record{}, fmt.Errorf("read %s/%d@%d: no answer within %s: is it in a transaction still open? %w", topic, partition, offset, readRecordTimeout, err)
		}
		if err != nil {
			return kfn.Record{}, err
		}
		for _, rec := range got.recs {
			if rec.Offset == offset {
				return rec, nil
			}
		}
	}
	return kfn.Record{}, fmt.Errorf("offset %d of %s/%d holds no committed record: a transaction marker, a record of an aborted transaction, or one compacted away", offset, topic, partition)
}

// readRecordTimeout bounds ReadRecord's wait for Kafka.
const readRecordTimeout = 10 * time.Second

// RecordFromMessage is the Record a handler sees for a Kafka message.
func RecordFromMessage(m kafka.Message) kfn.Record {
	return kfn.Record{
		Topic: m.Topic, Partition: int32(m.Partition), Offset: m.Offset,
		Key: m.Key, Value: m.Value, Headers: headersOf(m.Headers), Time: m.Time,
	}
}

// Log reads a topic's records in offset order for the operator's
// tools (kfn verify), over one connection setup that Close releases.
type Log struct{ source *Source }

// OpenLog connects to brokers with security's TLS and SASL.
func OpenLog(brokers []string, security kfn.KafkaSecurity) (*Log, error) {
	source, err := New(brokers, security, slog.New(slog.DiscardHandler))
	if err != nil {
		return nil, err
	}
	return &Log{source: source}, nil
}

// Close releases the log's idle connections.
func (l *Log) Close() { l.source.Close() }

// Partitions lists the topic's partition ids in order; a topic Kafka does
// not know is ErrTopicMissing.
func (l *Log) Partitions(ctx context.Context, topic string) ([]int32, error) {
	return l.source.Partitions(ctx, topic)
}

// OffsetRange returns the first offset Kafka still holds in a partition
// and its high watermark.
func (l *Log) OffsetRange(ctx context.Context, topic string, partition int32) (first, high int64, err error) {
	return l.source.OffsetRange(ctx, topic, partition)
}

// scanStall is how long Scan goes on asking for records that Kafka says
// it holds (below the high watermark) and does not return, before it
// gives up with an error.
const scanStall = 30 * time.Second

// Scan calls each with the offset and key of every committed record of
// the partition in [from, to), in offset order; to must not exceed the
// high watermark. Offsets that hold no committed record (a compacted log's
// gaps, transaction markers, the records of aborted transactions) are not
// passed to each: Scan reads at read_committed, as the workers do, whole
// fetch responses at a time (a kafka.Reader's queue costs several times
// more per record). It never skips records silently: when Kafka returns
// nothing from an offset below its high watermark for scanStall (a
// transaction left open, say), that is an error. A Kafka error (a leader
// change, a dropped connection) is retried with a new reader until
// scanStall has passed without progress.
func (l *Log) Scan(ctx context.Context, topic string, partition int32, from, to int64, each func(offset int64, key []byte) error) error {
	s := &scan{log: l, topic: topic, partition: partition, from: from, to: to, each: each, progress: time.Now()}
	for {
		err := s.run(ctx)
		var handler handlerError
		if errors.As(err, &handler) {
			return handler.err
		}
		if err == nil || ctx.Err() != nil || time.Since(s.progress) > scanStall {
			return err
		}
		// A leader change (a broker killed) or a dropped connection: ask
		// again who leads the partition and go on from where this read
		// stopped, until scanStall without progress.
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(scanRetry):
		}
	}
}

// scanRetry is the pause before a scan connects again after a Kafka error.
const scanRetry = 250 * time.Millisecond

// scan is one Log.Scan: where it is, and when it last moved.
type scan struct {
	log       *Log
	topic     string
	partition int32
	from, to  int64
	each      func(offset int64, key []byte) error
	progress  time.Time
}

// handlerError is an error of the caller's each: never retried.
type handlerError struct{ err error }

func (e handlerError) Error() string { return e.err.Error() }

// run reads from s.from with one reader until s.to, the high watermark,
// or an error.
func (s *scan) run(ctx context.Context) error {
	if s.from >= s.to {
		return nil
	}
	reader, err := s.log.source.Reader(s.topic, s.partition, s.from)
	if err != nil {
		return err
	}
	defer reader.Close()
	for s.from < s.to {
		last := s.from
		got, err := reader.fetchResponse(ctx)
		if err != nil {
			return err
		}
		for _, rec := range got.recs {
			if rec.Offset >= s.to {
				break
			}
			if err := s.each(rec.Offset, rec.Key); err != nil {
				return handlerError{err}
			}
		}
		s.from = min(got.next, s.to)
		switch {
		case s.from >= s.to || s.from >= got.high:
			return nil
		case s.from > last:
			s.progress = time.Now()
		case time.Since(s.progress) <= scanStall:
		case s.from >= got.lastStable:
			return fmt.Errorf("read %s/%d: a transaction still open holds offset %d (last stable offset %d, high watermark %d) after %s: its records are neither committed nor aborted yet", s.topic, s.partition, s.from, got.lastStable, got.high, scanStall)
		default:
			return fmt.Errorf("read %s/%d: Kafka returned no record from offset %d, below its high watermark %d, for %s", s.topic, s.partition, s.from, got.high, scanStall)
		}
	}
	return nil
}

// OffsetAt asks Kafka's time index for the first offset of the partition
// whose record's timestamp is at or after t, among the committed records.
// found is false when no record is (all are older). Kafka answers with
// the first such offset in offset order: with timestamps that go back
// (a producer's own CreateTime), records before it may be newer than t.
func (l *Log) OffsetAt(ctx context.Context, topic string, partition int32, t time.Time) (offset int64, found bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, offsetRangeTimeout)
	defer cancel()
	res, err := l.source.client.ListOffsets(ctx, &kafka.ListOffsetsRequest{IsolationLevel: kafka.ReadCommitted,
		Topics: map[string][]kafka.OffsetRequest{topic: {kafka.TimeOffsetOf(int(partition), t)}}})
	if err != nil {
		return 0, false, fmt.Errorf("list the offset of %s in %s/%d: %w", t.UTC().Format(time.RFC3339Nano), topic, partition, kafkaconn.Explain(err, l.source.brokers, l.source.security))
	}
	for _, p := range res.Topics[topic] {
		if p.Partition != int(partition) {
			continue
		}
		if p.Error != nil {
			return 0, false, fmt.Errorf("list the offset of %s in %s/%d: %w", t.UTC().Format(time.RFC3339Nano), topic, partition, p.Error)
		}
		// kafka-go files an answer under its record's timestamp; Kafka's
		// "no record" (offset -1, timestamp -1) lands on LastOffset
		// instead, and leaves Offsets empty.
		for o := range p.Offsets {
			return o, o >= 0, nil
		}
		return 0, false, nil
	}
	return 0, false, fmt.Errorf("list the offset of %s in %s/%d: no answer for the partition", t.UTC().Format(time.RFC3339Nano), topic, partition)
}
