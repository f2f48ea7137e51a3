package kafkasource

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	fetchapi "github.com/segmentio/kafka-go/protocol/fetch"

	"github.com/kfn-dev/kfn/internal/kafkaconn"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// Reader reads one Kafka partition in offset order at
// read_committed, and hands on only what a transaction committed: the
// records of aborted transactions and the transaction markers are passed
// over. kafka-go's own readers fetch at read_uncommitted (a kafka.Reader
// can ask for read_committed, but it drops the fetch response's list of
// aborted transactions, and delivers the markers as records), so kfn sends
// the Fetch request itself and filters each response as Kafka's consumers
// do.
//
// It asks the partition's leader through a transport of its own, whose
// metadata is fresh: a transport refreshes its metadata on a timer, not
// when a request fails, so after a leader change the engine closes the
// reader on the error and opens a new one.
//
// It also says how far it has read past what it handed on. A transaction
// marker, or an aborted transaction's records, at the end of what a
// producer wrote holds no record, so no record's commit would ever move
// the lane's cursor over it, and the lane would show a lag of one marker
// for good. With each record it hands on, the reader says where the
// cursor goes once the record is applied (past the markers and aborted
// records that follow it in its response), and it reports, as
// ErrPassedOnly, a response that held no record but took it further
// (passed), so that the lane can move its cursor there in a fenced
// transaction of its own.
//
// One goroutine uses a reader; Close may follow from another once that
// use has ended.
type Reader struct {
	source    *Source
	transport *kafka.Transport
	topic     string
	partition int32
	next      int64            // the offset the next fetch asks for
	fetchSize int32            // the bytes the next fetch asks for (sizeFetch)
	buffered  []kfn.Record     // fetched, not yet handed on
	end       int64            // where the cursor goes after the last buffered record (responseEnd)
	spare     []kfn.Record     // the last response's records, all handed on: the next one's room
	inFlight  chan fetchedPart // the fetch under way, if any
	stop      context.CancelFunc
	stopped   context.Context
	// passed is how far the reader has read without a gap it jumped
	// (outOfRange): every offset below it was handed on, or holds no
	// committed record. laneAt is where the lane's cursor stands
	// (NoteCursor); a response with no record while passed is beyond it
	// is ErrPassedOnly.
	passed, laneAt int64
	lastStable     int64 // the last response's last stable offset
}

// ErrPassedOnly means a fetch response held no committed record, while
// the reader has read past the lane's cursor (passed): the offsets up to
// there hold transaction markers or aborted records only, or records the
// lane holds but has not committed yet.
var ErrPassedOnly = errors.New("the reader passed offsets that hold no committed record")

// fetchMaxWait is how long the leader holds a fetch for records to arrive.
const fetchMaxWait = 250 * time.Millisecond

// MaxFetchBytes bounds one fetch response, which the reader decodes whole:
// 1 MiB, the Java consumer's max.partition.fetch.bytes, holds thousands of
// small records and keeps a lagging worker's memory at about that much
// per partition it reads (the leader still returns a first batch that is
// larger, so no record is too big to read). Source.FetchBytes lowers it.
const MaxFetchBytes = 1 << 20

// A lane reads ahead no more than its batches need. A fetch response is
// decoded whole, and a decoded record costs about three times its bytes on
// the wire for small records (its Record, its key and value copied out):
// 1 MiB of 80-byte records is 10,000 records, 20 batches of 500 ahead of
// the lane, about 2.6 MB per lane. So a reader's first fetch asks for
// minFetchBytes, and after each response it sizes the next fetch to about
// two batches of records of the size it saw (batchAhead ×
// Source.BatchRecords records), between minFetchBytes and the bound
// (Source.FetchBytes, MaxFetchBytes at most). A leader returns a first
// record batch larger than that whole, so no record is too big to read.
const (
	batchAhead    = 2
	minFetchBytes = 64 << 10
	// recordFraming is what a record costs on the wire besides its key,
	// value and headers (its length, attributes, offset and time deltas):
	// about 10 bytes, rounded up.
	recordFraming = 16
)

// sizeFetch is the bytes the next fetch asks for after a response that
// held recs: batchAhead batches of records like recs, within the bounds.
// Without records or a batch size it asks for the bound.
func (k *Source) sizeFetch(recs []kfn.Record) int32 {
	bound := k.fetchBytes()
	if len(recs) == 0 || k.BatchRecords <= 0 {
		return bound
	}
	total := 0
	for _, rec := range recs {
		total += len(rec.Key) + len(rec.Value) + recordFraming
		for _, h := range rec.Headers {
			total += len(h.Key) + len(h.Value)
		}
	}
	want := int64(total) / int64(len(recs)) * int64(batchAhead*k.BatchRecords)
	return int32(min(max(want, minFetchBytes), int64(bound)))
}

// fetchBytes is the bound of a fetch of k's readers.
func (k *Source) fetchBytes() int32 {
	if k.FetchBytes <= 0 || k.FetchBytes > MaxFetchBytes {
		return MaxFetchBytes
	}
	return int32(k.FetchBytes)
}

// fetchTimeout bounds one fetch round trip: the leader's wait plus the
// time to answer, after which the connection is taken to be dead.
const fetchTimeout = fetchMaxWait + 10*time.Second

// fetchedPart is one fetch's outcome: the committed records, the offset
// after everything the response passed (records, markers and aborted
// batches alike), and the partition's high watermark and last stable
// offset (below which every transaction is decided; records above it are
// not fetched yet). jumped says the fetch read nothing but moved to the
// first offset Kafka still holds (outOfRange).
type fetchedPart struct {
	recs             []kfn.Record
	next             int64
	high, lastStable int64
	jumped           bool
	err              error
}

// reader opens a reader of topic/partition positioned at offset.
func (k *Source) Reader(topic string, partition int32, offset int64) (*Reader, error) {
	transport, _, err := kafkaconn.Kafka(k.security)
	if err != nil {
		return nil, err
	}
	// Its metadata is the topic's alone, not the whole cluster's.
	transport.MetadataTopics = []string{topic}
	stopped, stop := context.WithCancel(context.Background())
	return &Reader{
		source: k, transport: transport, topic: topic, partition: partition,
		next: offset, fetchSize: min(minFetchBytes, k.fetchBytes()), stop: stop, stopped: stopped, passed: offset, laneAt: offset,
	}, nil
}

// NextRecord returns the next committed record, and where the cursor goes
// once it is applied: the offset of the record after it, or past the end
// of its response (responseEnd). It waits for one until ctx ends. A fetch
// that ctx interrupts goes on, and its records are the next call's: none
// is fetched twice or lost. A response without a record while the reader
// has passed the lane's cursor is ErrPassedOnly (Passed says how far).
func (r *Reader) NextRecord(ctx context.Context) (rec kfn.Record, after int64, err error) {
	for len(r.buffered) == 0 {
		got, err := r.fetchResponse(ctx)
		if err != nil {
			return kfn.Record{}, 0, err
		}
		r.buffered = got.recs
		if len(got.recs) == 0 {
			if r.passed > r.laneAt {
				return kfn.Record{}, 0, ErrPassedOnly
			}
			continue
		}
		r.end = responseEnd(got.recs, got.next, got.lastStable)
	}
	rec = r.buffered[0]
	r.buffered = r.buffered[1:]
	after = r.end
	if len(r.buffered) > 0 {
		after = r.buffered[0].Offset
	}
	r.passed = max(r.passed, after)
	return rec, after, nil
}

// responseEnd is where a lane's cursor goes once the last of recs, a
// response's records, is applied: past the response's batches after it
// (transaction markers, aborted records; next is the offset after the
// response), but not past the last stable offset.
func responseEnd(recs []kfn.Record, next, stable int64) int64 {
	return max(recs[len(recs)-1].Offset+1, min(next, stable))
}

// Passed is how far the reader has read: every offset below it was
// handed on, or holds no committed record.
func (r *Reader) Passed() int64 { return r.passed }

// LastStable is the last stable offset of the last response: where the
// partition's lag ends.
func (r *Reader) LastStable() int64 { return r.lastStable }

// CaughtUp says whether the reader has handed on every record of the
// partition up to the last stable offset its last response gave: a next
// record would have to be produced first.
func (r *Reader) CaughtUp() bool { return len(r.buffered) == 0 && r.passed >= r.lastStable }

// NoteCursor tells the reader where the lane's cursor stands, between two
// reads (no read may be under way).
func (r *Reader) NoteCursor(next int64) { r.laneAt = next }

// fetchResponse reads the next fetch response whole: its committed
// records, and the offsets that say how far the partition goes. The
// records are the caller's until its next call, which reuses their slice.
func (r *Reader) fetchResponse(ctx context.Context) (fetchedPart, error) {
	if len(r.buffered) > 0 {
		return fetchedPart{}, errors.New("fetchResponse after FetchMessage left records buffered")
	}
	if r.inFlight == nil {
		done := make(chan fetchedPart, 1)
		r.inFlight = done
		// The spare room's records were all handed on: the lane holds
		// those it still needs, so the room lets go of them, or it would
		// keep a whole response's values alive for another round.
		clear(r.spare)
		go func(from int64, size int32, room []kfn.Record) { done <- r.fetch(from, size, room) }(r.next, r.fetchSize, r.spare[:0])
	}
	select {
	case <-ctx.Done():
		return fetchedPart{}, ctx.Err()
	case got := <-r.inFlight:
		r.inFlight = nil
		if got.err != nil {
			return got, got.err
		}
		// A response read from where the reader had passed to, holding
		// no record, takes passed to its end, but not past the last
		// stable offset; one with records does as they are handed on. A
		// jump to the first offset Kafka holds is not read: the lane
		// judges that gap (skipGap).
		if !got.jumped && len(got.recs) == 0 && r.next == r.passed {
			r.passed = max(r.passed, min(got.next, got.lastStable))
		}
		r.next, r.spare, r.lastStable = got.next, got.recs, got.lastStable
		r.fetchSize = r.source.sizeFetch(got.recs)
		if cap(r.spare) > 2*len(r.spare)+64 {
			// A room much larger than what now arrives (the fetches got
			// smaller) would hold its size for good: let it go.
			r.spare = nil
		}
		return got, nil
	}
}

// Close ends the fetch under way, waits for it, and closes the reader's
// connections.
func (r *Reader) Close() error {
	r.stop()
	if r.inFlight != nil {
		<-r.inFlight
		r.inFlight = nil
	}
	r.transport.CloseIdleConnections()
	return nil
}

// fetch asks the partition's leader for the records from offset from, and
// appends them to room.
func (r *Reader) fetch(from int64, size int32, room []kfn.Record) fetchedPart {
	ctx, cancel := context.WithTimeout(r.stopped, fetchTimeout)
	defer cancel()
	res, err := r.transport.RoundTrip(ctx, kafka.TCP(r.source.brokers...), &fetchapi.Request{
		ReplicaID:      -1,
		MaxWaitTime:    int32(fetchMaxWait / time.Millisecond),
		MinBytes:       1,
		MaxBytes:       size,
		IsolationLevel: readCommitted,
		SessionID:      -1,
		SessionEpoch:   -1,
		Topics: []fetchapi.RequestTopic{{
			Topic: r.topic,
			Partitions: []fetchapi.RequestPartition{{
				Partition: r.partition, CurrentLeaderEpoch: -1, FetchOffset: from,
				LogStartOffset: -1, PartitionMaxBytes: size,
			}},
		}},
	})
	if err != nil {
		return fetchedPart{err: r.explain(from, err)}
	}
	part, err := r.partitionOf(res.(*fetchapi.Response))
	if err != nil {
		return fetchedPart{err: r.explain(from, err)}
	}
	if errors.Is(kafka.Error(part.ErrorCode), kafka.OffsetOutOfRange) {
		return r.outOfRange(ctx, from)
	}
	if part.ErrorCode != 0 {
		return fetchedPart{err: r.explain(from, kafka.Error(part.ErrorCode))}
	}
	stable := part.LastStableOffset
	if stable < 0 {
		stable = part.HighWatermark
	}
	recs, next, err := committedRecords(room, part, r.topic, from)
	if err != nil {
		return fetchedPart{err: r.explain(from, err)}
	}
	return fetchedPart{recs: recs, next: next, high: part.HighWatermark, lastStable: stable}
}

// readCommitted is the Fetch request's isolation level that stops at the
// last stable offset and lists the aborted transactions.
const readCommitted = 1

// partitionOf finds the reader's partition in a fetch response.
func (r *Reader) partitionOf(res *fetchapi.Response) (*fetchapi.ResponsePartition, error) {
	if res.ErrorCode != 0 {
		return nil, kafka.Error(res.ErrorCode)
	}
	for i := range res.Topics {
		t := &res.Topics[i]
		for j := range t.Partitions {
			if t.Topic == r.topic && t.Partitions[j].Partition == r.partition {
				return &t.Partitions[j], nil
			}
		}
	}
	return nil, errors.New("the fetch response does not hold the partition")
}

// outOfRange handles a fetch below the partition's first offset (records
// deleted by retention) the way kafka-go's reader does: it goes on from
// the first record Kafka holds, and the lane, seeing the gap, decides
// whether records expired (skipGap). A fetch past the end is an error.
func (r *Reader) outOfRange(ctx context.Context, from int64) fetchedPart {
	first, high, err := r.source.OffsetRange(ctx, r.topic, r.partition)
	switch {
	case err != nil:
		return fetchedPart{err: r.explain(from, err)}
	case from < first:
		return fetchedPart{next: first, high: high, lastStable: first, jumped: true}
	case from > high:
		return fetchedPart{err: fmt.Errorf("read %s/%d at offset %d: past the high watermark %d", r.topic, r.partition, from, high)}
	}
	return fetchedPart{next: from, high: high, lastStable: from, jumped: true} // moved back into range since: fetch again
}

func (r *Reader) explain(from int64, err error) error {
	return fmt.Errorf("read %s/%d at offset %d: %w", r.topic, r.partition, from, kafkaconn.Explain(err, r.source.brokers, r.source.security))
}

// committedRecords appends to recs the records of a read_committed fetch
// response at offset from or later that no aborted transaction wrote, and
// returns them with the offset after the last batch the response held
// (records, markers and aborted batches alike), from at the least.
//

// The leader lists the aborted transactions the response overlaps, each
// by its producer and first offset. A transactional batch of a producer
// with an aborted transaction begun at or before the batch belongs to it,
// up to that producer's abort marker; control batches (the commit and
// abort markers) carry no record for a handler.
func committedRecords(recs []kfn.Record, part *fetchapi.ResponsePartition, topic string, from int64) ([]kfn.Record, int64, error) {
	next := from
	stream, ok := part.RecordSet.Records.(*protocol.RecordStream)
	if !ok || stream == nil {
		return recs, next, nil
	}
	aborted := append([]fetchapi.ResponseTransaction(nil), part.AbortedTransactions...)
	sort.Slice(aborted, func(i, j int) bool { return aborted[i].FirstOffset < aborted[j].FirstOffset })
	inAborted := map[int64]bool{} // producers whose aborted transaction has begun
	for _, batch := range stream.Records {
		switch b := batch.(type) {
		case *protocol.ControlBatch:
			for len(aborted) > 0 && aborted[0].FirstOffset <= b.BaseOffset {
				inAborted[aborted[0].ProducerID] = true
				aborted = aborted[1:]
			}
			last, abort, err := readMarkers(b)
			if err != nil {
				return nil, next, err
			}
			if abort {
				delete(inAborted, b.ProducerID)
			}
			next = max(next, last+1)
		case *protocol.RecordBatch:
			for len(aborted) > 0 && aborted[0].FirstOffset <= b.BaseOffset {
				inAborted[aborted[0].ProducerID] = true
				aborted = aborted[1:]
			}
			skip := b.Attributes.Transactional() && inAborted[b.ProducerID]
			var err error
			if recs, next, err = appendRecords(recs, b, topic, part.Partition, from, next, skip); err != nil {
				return nil, next, err
			}
		default: // a message set of the pre-0.11 format: no transactions
			var err error
			if recs, next, err = appendRecords(recs, b, topic, part.Partition, from, next, false); err != nil {
				return nil, next, err
			}
		}
	}
	return recs, next, nil
}

// readMarkers reads a control batch: the offset of its last record, and
// whether it holds an abort marker.
func readMarkers(b *protocol.ControlBatch) (last int64, abort bool, err error) {
	last = b.BaseOffset
	for {
		rec, err := b.ReadControlRecord()
		if errors.Is(err, io.EOF) {
			return last, abort, nil
		}
		if err != nil {
			return last, abort, fmt.Errorf("read a transaction marker at offset %d: %w", b.BaseOffset, err)
		}
		last = max(last, rec.Offset)
		abort = abort || rec.Type == controlAbort
	}
}

// controlAbort is the type of a control record that ends a transaction
// aborted (commit is 1).
const controlAbort = 0

// appendRecords appends the records of batch at offset from or later to
// recs (none when skip), and returns the offset after its last record.
func appendRecords(recs []kfn.Record, batch protocol.RecordReader, topic string, partition int32, from, next int64, skip bool) ([]kfn.Record, int64, error) {
	for {
		rec, err := batch.ReadRecord()
		if errors.Is(err, io.EOF) {
			return recs, next, nil
		}
		if err != nil {
			return recs, next, fmt.Errorf("decode a record batch after offset %d: %w", next, err)
		}
		r, err := copyRecord(rec, topic, partition)
		if err != nil {
			return recs, next, err
		}
		next = max(next, rec.Offset+1)
		if !skip && rec.Offset >= from {
			recs = append(recs, r)
		}
	}
}

// copyRecord copies a decoded record out of the response's buffers.
func copyRecord(rec *protocol.Record, topic string, partition int32) (kfn.Record, error) {
	key, err := readBytes(rec.Key)
	if err != nil {
		return kfn.Record{}, fmt.Errorf("read the key of offset %d: %w", rec.Offset, err)
	}
	value, err := readBytes(rec.Value)
	if err != nil {
		return kfn.Record{}, fmt.Errorf("read the value of offset %d: %w", rec.Offset, err)
	}
	return kfn.Record{
		Topic: topic, Partition: partition, Offset: rec.Offset,
		Key: key, Value: value, Headers: headersOf(rec.Headers), Time: rec.Time,
	}, nil
}

// headersOf copies a record's headers as the handler sees them.
func headersOf(hs []protocol.Header) []kfn.Header {
	headers := make([]kfn.Header, len(hs))
	for i, h := range hs {
		headers[i] = kfn.Header{Key: h.Key, Value: h.Value}
	}
	return headers
}

// readBytes copies b (nil stays nil: a null key or a tombstone's value)
// and releases its buffer.
func readBytes(b protocol.Bytes) ([]byte, error) {
	if b == nil {
		return nil, nil
	}
	defer b.Close()
	return protocol.ReadAll(b)
}
