package operator

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/internal/naming"
	"github.com/kfn-dev/kfn/runtime"
)

// Lane kinds of PartitionStatus.Kind.
const (
	KindKafka   = "kafka" // a partition of a Kafka topic
	KindSubject = "nats"  // a lane of a NATS-triggered function (its Subject)
)

// PartitionStatus is what `kfn status` shows for one lane of one function:
// a Kafka partition, or a lane of a NATS-triggered function, whose cursor
// row has the subject as its topic and the lane as its partition.
type PartitionStatus struct {
	Function      string    `json:"function"`
	Kind          string    `json:"kind"`  // KindKafka or KindSubject
	Topic         string    `json:"topic"` // the Kafka topic, or the subject of a NATS-triggered function
	Partition     int32     `json:"partition"`
	Owner         string    `json:"owner"`        // the worker that last claimed it in Postgres
	LeaseHolder   string    `json:"lease_holder"` // who holds its NATS lease now ("" when free or unknown)
	LeaseToken    uint64    `json:"lease_token"`
	Epoch         int64     `json:"epoch"`
	Cursor        int64     `json:"cursor"` // Kafka: the next offset; NATS: the stream sequence after the last applied event
	HighWater     int64     `json:"high_water"`
	Generation    int       `json:"generation"`           // re-executions that gave its events new ids
	KafkaHighMark int64     `json:"kafka_high_watermark"` // -1 when Kafka could not be asked, and for a NATS lane
	Lag           int64     `json:"lag"`                  // -1 when unknown; NATS: events not delivered yet plus delivered and not acked
	LastCommit    time.Time `json:"last_commit"`
	LastCommitAge string    `json:"last_commit_age"`
	// Lanes is how many lanes a NATS-triggered function's subject is
	// spread over (0 for a Kafka partition).
	Lanes int `json:"lanes,omitempty"`
	// The durable JetStream consumer of a NATS lane (naming.LaneConsumer),
	// when NATS could be asked.
	Stream     string `json:"stream,omitempty"`
	Pending    *int64 `json:"pending,omitempty"`     // events matching the subject not delivered yet
	AckPending *int64 `json:"ack_pending,omitempty"` // events delivered and not acked yet
	AckFloor   *int64 `json:"ack_floor,omitempty"`   // stream sequence below which every event is acked
	// KeyLanes is the lane's key-lanes (KeyConcurrency > 1), by index:
	// each one's progress, the offset (or stream sequence) after the last
	// record it committed. A key-lane commits its records in order, so the
	// record at the cursor, which the cursor waits on, is one of those of
	// the key-lanes listed in WaitsOn: those not past the cursor. Ahead is
	// how far the furthest key-lane got past the cursor (0: none did).
	KeyLanes []inbox.KeyLane `json:"key_lanes,omitempty"`
	WaitsOn  []int           `json:"waits_on,omitempty"`
	Ahead    int64           `json:"ahead,omitempty"`
	// Problem says why a part of this lane's status is unknown.
	Problem string `json:"problem,omitempty"`
}

// readKeyLanes adds each lane's key-lanes to out.
func (r *StatusReader) readKeyLanes(ctx context.Context, out []PartitionStatus, function string) error {
	rows, err := r.pool.Query(ctx, `
SELECT consumer, topic, partition, lane, lanes, epoch, next_offset, updated_at FROM kfn.key_lanes
 WHERE consumer = $1 OR $1 = '' ORDER BY consumer, topic, partition, lane`, function)
	if err != nil {
		return fmt.Errorf("read key-lanes: %w", err)
	}
	type lane struct {
		function, topic string
		partition       int32
	}
	byLane := map[lane][]inbox.KeyLane{}
	var l lane
	var k inbox.KeyLane
	_, err = pgx.ForEachRow(rows, []any{&l.function, &l.topic, &l.partition, &k.Lane, &k.Lanes, &k.Epoch, &k.NextOffset, &k.UpdatedAt}, func() error {
		byLane[l] = append(byLane[l], k)
		return nil
	})
	if err != nil {
		return fmt.Errorf("read key-lanes: %w", err)
	}
	for i := range out {
		p := &out[i]
		p.KeyLanes = byLane[lane{p.Function, p.Topic, p.Partition}]
		for _, k := range p.KeyLanes {
			p.Ahead = max(p.Ahead, k.NextOffset-p.Cursor)
		}
		if p.Ahead == 0 {
			continue // every record the key-lanes committed is under the cursor: it waits on none
		}
		for _, k := range p.KeyLanes {
			if k.NextOffset <= p.Cursor {
				p.WaitsOn = append(p.WaitsOn, k.Lane)
			}
		}
	}
	return nil
}

// Status reads every cursor (of one function, or all when function is empty)
// from Postgres, the lease holders from NATS (when js is not nil), the
// partitions' high watermarks from Kafka (when brokers are given) and the
// JetStream consumers of NATS-triggered functions (when js is not nil).
// When NATS or Kafka cannot be asked, the Postgres side is still returned,
// with the error.
func Status(ctx context.Context, pool *pgxpool.Pool, brokers []string, js jetstream.JetStream, leaseBucket, function string) ([]PartitionStatus, error) {
	r := NewStatusReader(pool, brokers, js, leaseBucket)
	defer r.Close()
	return r.Read(ctx, function)
}

// StatusReader reads the status of every lane again and again (kfn status
// --watch) over the same connections.
type StatusReader struct {
	pool   *pgxpool.Pool
	js     jetstream.JetStream
	bucket string
	kafka  *kafkaClient // nil without brokers

	kafkaErr error // the Kafka security settings' problem, which Read returns
}

// NewStatusReader makes a StatusReader; brokers and js may be empty.
func NewStatusReader(pool *pgxpool.Pool, brokers []string, js jetstream.JetStream, leaseBucket string) *StatusReader {
	return NewStatusReaderSecure(pool, brokers, runtime.KafkaSecurity{}, js, leaseBucket)
}

// NewStatusReaderSecure is NewStatusReader connecting to Kafka with
// security's TLS and SASL.
func NewStatusReaderSecure(pool *pgxpool.Pool, brokers []string, security runtime.KafkaSecurity, js jetstream.JetStream, leaseBucket string) *StatusReader {
	if leaseBucket == "" {
		leaseBucket = lease.DefaultBucket
	}
	r := &StatusReader{pool: pool, js: js, bucket: leaseBucket}
	if len(brokers) > 0 {
		r.kafka, r.kafkaErr = newKafkaClient(brokers, security)
	}
	return r
}

// Close closes the Kafka connections.
func (r *StatusReader) Close() {
	if r.kafka != nil {
		r.kafka.close()
	}
}

// Read returns the status of function's lanes (every function's when it is
// empty), in function, topic and partition order.
func (r *StatusReader) Read(ctx context.Context, function string) ([]PartitionStatus, error) {
	if r.kafkaErr != nil {
		return nil, r.kafkaErr
	}
	rows, err := r.pool.Query(ctx, `
SELECT c.consumer, c.topic, c.partition, c.owner, c.epoch, c.next_offset, c.high_water, c.generation, c.updated_at,
       EXISTS (SELECT 1 FROM kfn.event_inbox e WHERE e.consumer = c.consumer),
       coalesce((SELECT l.lanes FROM kfn.subject_lanes l WHERE l.consumer = c.consumer AND l.subject = c.topic), 0)
  FROM kfn.cursors c WHERE c.consumer = $1 OR $1 = '' ORDER BY c.consumer, c.topic, c.partition`, function)
	if err != nil {
		return nil, fmt.Errorf("read cursors: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (PartitionStatus, error) {
		var s PartitionStatus
		var handledEvents bool
		err := row.Scan(&s.Function, &s.Topic, &s.Partition, &s.Owner, &s.Epoch, &s.Cursor, &s.HighWater, &s.Generation, &s.LastCommit, &handledEvents, &s.Lanes)
		s.Kind = KindKafka
		if handledEvents || s.Lanes > 0 {
			s.Kind = KindSubject // a function consumes a topic or a subject, never both
		}
		s.KafkaHighMark, s.Lag = -1, -1
		s.LastCommitAge = time.Since(s.LastCommit).Round(time.Second).String()
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("read cursors: %w", err)
	}
	if err := r.readKeyLanes(ctx, out, function); err != nil {
		return nil, err
	}
	var errs []error
	if r.js != nil {
		if err := r.readNATS(ctx, out); err != nil {
			errs = append(errs, err)
		}
	}
	if r.kafka != nil {
		if err := r.readKafka(ctx, out); err != nil {
			errs = append(errs, err)
		}
	}
	return out, errors.Join(errs...)
}

// readNATS fills in the lease holders and the JetStream consumers of the
// NATS lanes. A lane whose function's durable consumer on the stream of
// its topic filters that subject is a NATS lane, whether or not it has
// handled an event yet.
func (r *StatusReader) readNATS(ctx context.Context, out []PartitionStatus) error {
	for i := range out {
		s := &out[i]
		if s.Partition != 0 && s.Kind != KindSubject {
			continue
		}
		consumer := naming.LaneConsumer(s.Function, int(s.Partition), max(s.Lanes, 1))
		lane, err := findSubjectLane(ctx, r.js, consumer, s.Topic)
		if err != nil {
			return fmt.Errorf("read JetStream consumers: %w", err)
		}
		if lane == nil {
			if s.Kind == KindSubject {
				s.Problem = fmt.Sprintf("no durable JetStream consumer %q filters %s", consumer, s.Topic)
			}
			continue
		}
		s.Kind, s.Stream = KindSubject, lane.Stream
		pending, ackPending, floor := int64(lane.NumPending), int64(lane.NumAckPending), int64(lane.AckFloor.Stream)
		s.Pending, s.AckPending, s.AckFloor = &pending, &ackPending, &floor
		s.Lag = pending + ackPending
	}
	store, err := lease.OpenExisting(ctx, r.js, r.bucket, slog.New(slog.DiscardHandler))
	if err != nil {
		return fmt.Errorf("read leases from NATS: %w", err)
	}
	installation, err := naming.InstallationID(ctx, r.pool)
	if err != nil {
		return err
	}
	for i := range out {
		s := &out[i]
		h, err := store.Holder(ctx, naming.LeaseGroup(installation, s.Function, s.Topic), naming.LeaseItem(s.Partition))
		if err != nil && !errors.Is(err, lease.ErrNotHeld) {
			return fmt.Errorf("read leases from NATS: %w", err)
		}
		s.LeaseHolder, s.LeaseToken = h.Owner, h.Token
	}
	return nil
}

// readKafka fills in the high watermarks and lags of the Kafka lanes, with
// one ListOffsets round per topic. A topic Kafka does not know is that
// lane's problem, not an error: it may be a subject whose function has not
// handled an event yet, read without --nats-url.
func (r *StatusReader) readKafka(ctx context.Context, out []PartitionStatus) error {
	byTopic := map[string][]int{}
	for i, s := range out {
		if s.Kind == KindKafka {
			byTopic[s.Topic] = append(byTopic[s.Topic], i)
		}
	}
	topics := make([]string, 0, len(byTopic))
	for t := range byTopic {
		topics = append(topics, t)
	}
	slices.Sort(topics)
	for _, topic := range topics {
		idx := byTopic[topic]
		parts := make([]int32, len(idx))
		for j, i := range idx {
			parts[j] = out[i].Partition
		}
		ranges, err := r.kafka.offsetRanges(ctx, topic, parts)
		if err != nil {
			if errors.Is(err, kafka.UnknownTopicOrPartition) {
				for _, i := range idx {
					out[i].Problem = fmt.Sprintf("Kafka has no topic %s (a NATS subject? pass --nats-url)", topic)
				}
				continue
			}
			return fmt.Errorf("cannot read high watermarks from Kafka at %v: %w", r.kafka.brokers, err)
		}
		for _, i := range idx {
			s := &out[i]
			rg, ok := ranges[s.Partition]
			if !ok {
				s.Problem = fmt.Sprintf("Kafka has no partition %d of %s", s.Partition, topic)
				continue
			}
			s.KafkaHighMark = rg.high
			s.Lag = max(0, rg.high-s.Cursor)
		}
	}
	return nil
}

// subjectLane is the durable JetStream consumer of a NATS-triggered
// function, as JetStream reports it.
type subjectLane struct {
	Stream string
	*jetstream.ConsumerInfo
}

// findSubjectLane returns the durable consumer named consumer (a lane's,
// naming.LaneConsumer) on the stream that captures subject, or nil when
// there is none or it does not filter subject.
func findSubjectLane(ctx context.Context, js jetstream.JetStream, consumer, subject string) (*subjectLane, error) {
	if js == nil {
		return nil, nil
	}
	stream, err := js.StreamNameBySubject(ctx, subject)
	if errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, jetstream.ErrInvalidSubject) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("find the stream of %s: %w", subject, err)
	}
	cons, err := js.Consumer(ctx, stream, consumer)
	if errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrInvalidConsumerName) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read consumer %s of stream %s: %w", consumer, stream, err)
	}
	info, err := cons.Info(ctx)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read consumer %s of stream %s: %w", consumer, stream, err)
	}
	if info.Config.FilterSubject != subject && !slices.Contains(info.Config.FilterSubjects, subject) {
		return nil, nil
	}
	return &subjectLane{Stream: stream, ConsumerInfo: info}, nil
}

// kafkaClient asks Kafka for the offsets the operator's tools need, over
// one transport that Close releases.
type kafkaClient struct {
	brokers   []string
	security  runtime.KafkaSecurity
	client    *kafka.Client
	transport *kafka.Transport
}

func newKafkaClient(brokers []string, security runtime.KafkaSecurity) (*kafkaClient, error) {
	t, _, err := kafkaconn.Kafka(security)
	if err != nil {
		return nil, err
	}
	return &kafkaClient{brokers: brokers, security: security, transport: t, client: &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second, Transport: t}}, nil
}

func (k *kafkaClient) close() { k.transport.CloseIdleConnections() }

// offsetRange is a partition's first offset Kafka still holds and its
// high watermark (the offset of the next record).
type offsetRange struct{ first, high int64 }

// offsetRanges lists the offset ranges of a topic's partitions. A topic
// Kafka does not know is kafka.UnknownTopicOrPartition.
func (k *kafkaClient) offsetRanges(ctx context.Context, topic string, partitions []int32) (map[int32]offsetRange, error) {
	reqs := make([]kafka.OffsetRequest, 0, 2*len(partitions))
	for _, p := range partitions {
		reqs = append(reqs, kafka.FirstOffsetOf(int(p)), kafka.LastOffsetOf(int(p)))
	}
	resp, err := k.client.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	if err != nil {
		return nil, fmt.Errorf("list offsets of %s: %w", topic, err)
	}
	out := make(map[int32]offsetRange, len(partitions))
	for _, po := range resp.Topics[topic] {
		if po.Error != nil {
			return nil, fmt.Errorf("list offsets of %s/%d: %w", topic, po.Partition, po.Error)
		}
		out[int32(po.Partition)] = offsetRange{first: po.FirstOffset, high: po.LastOffset}
	}
	return out, nil
}

// offsetsForTime resolves a time to an offset in each partition through
// Kafka's offsets-for-times (ListOffsets with a timestamp): the first
// offset whose record's timestamp is at or after at, or -1 when no record
// is that recent.
func (k *kafkaClient) offsetsForTime(ctx context.Context, topic string, partitions []int32, at time.Time) (map[int32]int64, error) {
	reqs := make([]kafka.OffsetRequest, len(partitions))
	for i, p := range partitions {
		reqs[i] = kafka.TimeOffsetOf(int(p), at)
	}
	resp, err := k.client.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	if err != nil {
		return nil, fmt.Errorf("offsets of %s at %s: %w", topic, at.Format(time.RFC3339Nano), err)
	}
	out := make(map[int32]int64, len(partitions))
	for _, po := range resp.Topics[topic] {
		if po.Error != nil {
			return nil, fmt.Errorf("offset of %s/%d at %s: %w", topic, po.Partition, at.Format(time.RFC3339Nano), po.Error)
		}
		out[int32(po.Partition)] = -1
		for off := range po.Offsets { // one answer: the requested timestamp's
			out[int32(po.Partition)] = off
		}
	}
	for _, p := range partitions {
		if _, ok := out[p]; !ok {
			return nil, fmt.Errorf("offset of %s/%d at %s: partition missing from Kafka's answer", topic, p, at.Format(time.RFC3339Nano))
		}
	}
	return out, nil
}
