package outbox

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/internal/pgdata"
)

// Shards is the number of relay shards. An event's shard is a hash of its
// key, so all events of one key are relayed by one relay, in order.
const Shards = 32

// Event is what a function emits. Only Subject is required.
type Event struct {
	// Subject is the NATS subject the event is published on, e.g. "orders.accepted".
	Subject string
	// Type is the CloudEvents type; it defaults to Subject.
	Type string
	// Key orders events: events with one key reach the stream in emit order.
	// It defaults to the source record's key. It may hold any bytes (a Go
	// string does); the outbox stores it as bytea. On the message it is the
	// kfn-key header when it is a valid header value, else kfn-key-b64.
	Key string
	// Data is the payload.
	Data []byte
	// Headers are extra message headers. Names and values must be valid
	// UTF-8 without NUL bytes (emitting others fails the record), and the
	// relay drops those NATS cannot carry.
	Headers map[string]string
}

// Origin says which source record an event was emitted for. Together with the
// emit index it determines the event id.
type Origin struct {
	Consumer  string // the emitting function
	Topic     string // Kafka topic or NATS subject of the source record
	Partition int32
	Offset    int64
	// SourceID is the source record's identity (see SourceID).
	SourceID string
	// TraceParent, TraceState and Baggage are the W3C trace context the
	// event continues (the span that handled the source record; see
	// Propagator) and the source's baggage, each empty when there is none
	// or it is invalid (ValidTraceParent, ValidTraceState, ValidBaggage;
	// Insert checks the first two and that the baggage is header text).
	// Insert adds them to the event's headers unless the event sets its
	// own traceparent.
	TraceParent string
	TraceState  string
	Baggage     string
}

// KafkaSourceID is the identity of a Kafka record within a consumer:
// "topic/partition/offset".
func KafkaSourceID(topic string, partition int32, offset int64) string {
	return topic + "/" + strconv.Itoa(int(partition)) + "/" + strconv.FormatInt(offset, 10)
}

// SourceID is the identity of the record whose handling emits events, from
// which their ids derive (EventID): KafkaSourceID for a Kafka record, or
// "event/<event id>" for a NATS event (eventID non-empty). A record
// re-executed by a replay (generation > 0) gets "#<generation>" appended,
// so that its events get new ids and downstream inboxes apply them instead
// of skipping them as repeats.
func SourceID(topic string, partition int32, offset int64, eventID string, generation int) string {
	id := KafkaSourceID(topic, partition, offset)
	if eventID != "" {
		id = "event/" + eventID
	}
	if generation > 0 {
		id += "#" + strconv.Itoa(generation)
	}
	return id
}

// EventID derives the id of the index-th event emitted while handling the
// source record, formatted as a UUID (version 8, name-based). The same
// function handling the same record emits the same ids on every replay, so
// JetStream's Nats-Msg-Id dedup and downstream inboxes recognise repeats.
func EventID(consumer, sourceID string, index int) string {
	h := sha256.New()
	fmt.Fprintf(h, "%d:%s|%d:%s|%d", len(consumer), consumer, len(sourceID), sourceID, index)
	sum := h.Sum(nil)[:16]
	sum[6] = sum[6]&0x0f | 0x80 // version 8
	sum[8] = sum[8]&0x3f | 0x80 // RFC 4122 variant
	return formatUUID(sum)
}

// ShardOf returns the relay shard of an event key: a hash of its bytes,
// whatever they are.
func ShardOf(key string) int { return int(keyHash(key) % Shards) }

// LaneOf returns which of lanes lanes of a NATS-triggered function handles
// the events of key: the same 32-bit FNV-1a hash of the key's bytes as
// ShardOf (and as kafka-go's Hash balancer), modulo lanes. It is stable
// across processes and versions: lanes of one function must agree on it.
func LaneOf(key []byte, lanes int) int {
	if lanes <= 1 {
		return 0
	}
	return int(keyHash(key) % uint32(lanes))
}

// keyHash is the 32-bit FNV-1a hash of a key's bytes.
func keyHash[K string | []byte](key K) uint32 {
	const offset, prime = 2166136261, 16777619
	h := uint32(offset)
	for i := 0; i < len(key); i++ {
		h ^= uint32(key[i])
		h *= prime
	}
	return h
}

// Row is one outbox row ready to be written.
type Row struct {
	EventID string
	Shard   int
	Event   Event
	Origin  Origin
}

// NewRow fills in the derived fields of the index-th event emitted for origin.
// sourceKey is the source record's key, the default ordering key.
func NewRow(origin Origin, index int, sourceKey string, ev Event) Row {
	if ev.Type == "" {
		ev.Type = ev.Subject
	}
	if ev.Key == "" {
		ev.Key = sourceKey
	}
	if ev.Data == nil {
		ev.Data = []byte{}
	}
	return Row{
		EventID: EventID(origin.Consumer, origin.SourceID, index),
		Shard:   ShardOf(ev.Key),
		Event:   ev,
		Origin:  origin,
	}
}

const insertSQL = `
INSERT INTO kfn.outbox (event_id, subject, event_type, event_key, shard, data, headers,
                        source, source_topic, source_partition, source_offset, created_at)
SELECT r.event_id, r.subject, r.event_type, r.event_key, r.shard, r.data, r.headers::jsonb,
       r.source, r.source_topic, r.source_partition, r.source_offset, $12
  FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::int[], $6::bytea[], $7::text[],
              $8::text[], $9::text[], $10::int[], $11::bigint[])
       WITH ORDINALITY AS r(event_id, subject, event_type, event_key, shard, data, headers,
                            source, source_topic, source_partition, source_offset, n)
 ORDER BY r.n`

// Insert writes rows into the outbox inside tx, in slice order (ids grow in
// that order), with one statement (QueueInsert) in one round trip. A row
// whose event id already exists fails the transaction: ids are
// deterministic, so that would mean a record was applied twice.
func Insert(ctx context.Context, tx pgx.Tx, rows []Row) error {
	if len(rows) == 0 {
		return nil
	}
	b := &pgx.Batch{}
	QueueInsert(b, rows)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("insert %d outbox rows: %w", len(rows), err)
	}
	return nil
}

// QueueInsert queues on b the statement that writes rows into the outbox,
// in slice order, as Insert does; nothing when rows is empty. A caller
// pipelines it with its COMMIT: Postgres skips the COMMIT if the INSERT
// fails.
func QueueInsert(b *pgx.Batch, rows []Row) {
	if len(rows) == 0 {
		return
	}
	n := len(rows)
	ids, subjects, types, sources, topics, headers := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	keys, data := make([][]byte, n), make([][]byte, n)
	shards, partitions := make([]int32, n), make([]int32, n)
	offsets := make([]int64, n)
	for i, r := range rows {
		h, _ := json.Marshal(r.headers()) // a map of strings always marshals
		ids[i], subjects[i], types[i], keys[i], shards[i], data[i], headers[i] = r.EventID, r.Event.Subject, r.Event.Type, []byte(r.Event.Key), int32(r.Shard), r.Event.Data, string(h)
		sources[i], topics[i], partitions[i], offsets[i] = r.Origin.Consumer, pgdata.Text(r.Origin.Topic), r.Origin.Partition, r.Origin.Offset
	}
	b.Queue(insertSQL, ids, subjects, types, keys, shards, data, headers, sources, topics, partitions, offsets, time.Now())
}

// headers are the row's message headers: the event's own, plus the source
// record's trace context unless the event sets its own.
func (r Row) headers() map[string]string {
	headers := r.Event.Headers
	if headers == nil {
		headers = map[string]string{}
	}
	if _, own := headers[HeaderTraceParent]; !own && ValidTraceParent(r.Origin.TraceParent) {
		headers = withHeader(headers, HeaderTraceParent, r.Origin.TraceParent)
		if _, ownState := headers[HeaderTraceState]; !ownState && r.Origin.TraceState != "" && ValidTraceState(r.Origin.TraceState) {
			headers = withHeader(headers, HeaderTraceState, r.Origin.TraceState)
		}
		if _, ownBaggage := headers[HeaderBaggage]; !ownBaggage && r.Origin.Baggage != "" && ValidHeaderValue(r.Origin.Baggage) {
			headers = withHeader(headers, HeaderBaggage, r.Origin.Baggage)
		}
	}
	return headers
}

func withHeader(h map[string]string, k, v string) map[string]string {
	out := make(map[string]string, len(h)+1)
	for hk, hv := range h {
		out[hk] = hv
	}
	out[k] = v
	return out
}
