package kafkasource

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	fetchapi "github.com/segmentio/kafka-go/protocol/fetch"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kfn-dev/kfn/internal/devstack"
	"github.com/kfn-dev/kfn/runtime"
)

// batchOf is a record batch of producer pid (-1: none) at offsets
// base, base+1, … with values "<base+i>".
func batchOf(pid int64, transactional bool, base int64, n int) *protocol.RecordBatch {
	recs := make([]protocol.Record, n)
	for i := range recs {
		off := base + int64(i)
		recs[i] = protocol.Record{Offset: off, Value: protocol.NewBytes(fmt.Appendf(nil, "%d", off))}
	}
	b := &protocol.RecordBatch{BaseOffset: base, ProducerID: pid, Records: protocol.NewRecordReader(recs...)}
	if transactional {
		b.Attributes = protocol.Transactional
	}
	return b
}

// markerOf is producer pid's commit (or abort) marker at offset off.
func markerOf(pid, off int64, commit bool) *protocol.ControlBatch {
	typ := int16(controlAbort)
	if commit {
		typ = 1
	}
	b := protocol.NewControlBatch(protocol.ControlRecord{Offset: off, Type: typ})
	b.BaseOffset, b.ProducerID = off, pid
	b.Attributes = protocol.Transactional | protocol.Control
	return b
}

// offsetsOf reads part from offset from, at a last stable offset of
// stable, and checks each record holds its offset as value. It returns the
// records' offsets and where the cursor goes once each is applied (the
// next record's offset, or responseEnd), and the offset after the
// response.
func offsetsOf(t *testing.T, part *fetchapi.ResponsePartition, from, stable int64) (offsets, cursors []int64, next int64) {
	t.Helper()
	recs, next, err := committedRecords(nil, part, "t", from)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range recs {
		if string(r.Value) != fmt.Sprint(r.Offset) {
			t.Errorf("offset %d: value %q", r.Offset, r.Value)
		}
		offsets = append(offsets, r.Offset)
		if i+1 < len(recs) {
			cursors = append(cursors, recs[i+1].Offset)
		} else {
			cursors = append(cursors, responseEnd(recs, next, stable))
		}
	}
	return offsets, cursors, next
}

// TestCommittedRecordsPassOverAbortedTransactionsAndMarkers: a response
// that interleaves two transactional producers (7 commits, 8 aborts) with
// a plain one (-1) and an idempotent one (9) yields only what committed,
// and the offset after its last batch, markers included. Once a record is
// applied, the cursor goes past the markers and aborted records after it:
// after the last one, past the aborted batch and the marker (12, 13) to
// the end of the response.
func TestCommittedRecordsPassOverAbortedTransactionsAndMarkers(t *testing.T) {
	part := &fetchapi.ResponsePartition{
		AbortedTransactions: []fetchapi.ResponseTransaction{{ProducerID: 8, FirstOffset: 2}, {ProducerID: 8, FirstOffset: 12}},
		RecordSet: protocol.RecordSet{Records: &protocol.RecordStream{Records: []protocol.RecordReader{
			batchOf(7, true, 0, 2),   // 0-1: committed at 6
			batchOf(8, true, 2, 2),   // 2-3: aborted at 7
			batchOf(-1, false, 4, 1), // 4: no transaction
			batchOf(9, false, 5, 1),  // 5: idempotent, no transaction
			markerOf(7, 6, true),
			markerOf(8, 7, false),
			batchOf(8, true, 8, 2), // 8-9: producer 8 again, committed at 10
			markerOf(8, 10, true),
			batchOf(-1, false, 11, 1), // 11
			batchOf(8, true, 12, 1),   // 12: aborted at 13
			markerOf(8, 13, false),
		}}},
	}
	got, cursors, next := offsetsOf(t, part, 0, 100)
	if want := []int64{0, 1, 4, 5, 8, 9, 11}; !slices.Equal(got, want) {
		t.Errorf("committed offsets %v, want %v", got, want)
	}
	if want := []int64{1, 4, 5, 8, 9, 11, 14}; !slices.Equal(cursors, want) {
		t.Errorf("cursors after each record %v, want %v", cursors, want)
	}
	// Never past the last stable offset.
	tail := &fetchapi.ResponsePartition{AbortedTransactions: []fetchapi.ResponseTransaction{{ProducerID: 8, FirstOffset: 12}}, RecordSet: protocol.RecordSet{Records: &protocol.RecordStream{Records: []protocol.RecordReader{
		batchOf(-1, false, 11, 1), batchOf(8, true, 12, 1), markerOf(8, 13, false),
	}}}}
	if _, cursors, next := offsetsOf(t, tail, 11, 13); len(cursors) != 1 || cursors[0] != 13 || next != 14 {
		t.Errorf("a response read to 14 at a last stable offset of 13: cursors %v, next %d; want [13], 14", cursors, next)
	}
	if next != 14 {
		t.Errorf("next offset %d, want 14 (after the last marker)", next)
	}
}

// TestCommittedRecordsFromInsideAResponse: records below the fetch offset
// (Kafka returns whole batches) are not handed on, and an aborted
// transaction begun before the fetch offset still hides its later batches.
func TestCommittedRecordsFromInsideAResponse(t *testing.T) {
	part := &fetchapi.ResponsePartition{
		AbortedTransactions: []fetchapi.ResponseTransaction{{ProducerID: 8, FirstOffset: 0}},
		RecordSet: protocol.RecordSet{Records: &protocol.RecordStream{Records: []protocol.RecordReader{
			batchOf(-1, false, 3, 4), // 3-6, fetched from 5
			batchOf(8, true, 7, 2),   // 7-8: the aborted transaction begun at 0
			markerOf(8, 9, false),
			batchOf(8, true, 10, 1), // 10: a new transaction of producer 8, never aborted
		}}},
	}
	got, cursors, next := offsetsOf(t, part, 5, 100)
	if want := []int64{6, 10, 11}; !slices.Equal(cursors, want) {
		t.Errorf("cursors after each record %v, want %v", cursors, want)
	}
	if want := []int64{5, 6, 10}; !slices.Equal(got, want) {
		t.Errorf("committed offsets %v, want %v", got, want)
	}
	if next != 11 {
		t.Errorf("next offset %d, want 11", next)
	}
}

// TestCommittedRecordsOfAnEmptyResponse: no records leave the offset where
// the fetch asked.
func TestCommittedRecordsOfAnEmptyResponse(t *testing.T) {
	got, _, next := offsetsOf(t, &fetchapi.ResponsePartition{}, 42, 0)
	if len(got) != 0 || next != 42 {
		t.Errorf("got %v and next %d, want none and 42", got, next)
	}
}

// BenchmarkPartitionReaders reads the same 20,000 records of 200 random
// bytes from one partition of the embedded broker with the workers' reader
// (read_committed, whole fetch responses) and with the kafka.Reader it
// replaced (its settings then: 16 MiB fetches, a queue of 1,000), and
// reports the cost per record:
//
//	go test -run '^$' -bench BenchmarkPartitionReaders -benchmem ./internal/kafkasource/
func BenchmarkPartitionReaders(b *testing.B) {
	const records = 20000
	source, brokers := onePartitionTopic(b, "bench")
	ctx := context.Background()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.DefaultProduceTopic("bench"), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range records {
		value := make([]byte, 200) // random: a batch compresses as little as real data
		for j := range value {
			value[j] = byte(rng.Uint32())
		}
		cl.Produce(ctx, &kgo.Record{Key: fmt.Appendf(nil, "k%d", i%64), Value: value}, func(_ *kgo.Record, err error) {
			if err != nil {
				b.Error(err)
			}
		})
	}
	if err := cl.Flush(ctx); err != nil {
		b.Fatal(err)
	}
	readAll := func(b *testing.B, fetch func(context.Context) (int64, error)) {
		for n := 0; n < records; n++ {
			offset, err := fetch(ctx)
			if err != nil || offset != int64(n) {
				b.Fatalf("record %d: offset %d, %v", n, offset, err)
			}
		}
	}
	b.Run("Reader", func(b *testing.B) {
		for b.Loop() {
			r, err := source.Reader("bench", 0, 0)
			if err != nil {
				b.Fatal(err)
			}
			readAll(b, func(ctx context.Context) (int64, error) {
				rec, _, err := r.NextRecord(ctx)
				return rec.Offset, err
			})
			r.Close()
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*records), "ns/record")
	})
	b.Run("kafka.Reader", func(b *testing.B) {
		for b.Loop() {
			r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Dialer: source.dialer, Topic: "bench",
				MinBytes: 1, MaxBytes: 16 << 20, MaxWait: 250 * time.Millisecond, QueueCapacity: 1000, ReadLagInterval: -1})
			if err := r.SetOffset(0); err != nil {
				b.Fatal(err)
			}
			readAll(b, func(ctx context.Context) (int64, error) {
				m, err := r.FetchMessage(ctx)
				return m.Offset, err
			})
			r.Close()
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*records), "ns/record")
	})
}

// onePartitionTopic starts an embedded broker with a topic of one
// partition, and returns a Source of it and the broker's addresses; both
// end with tb.
func onePartitionTopic(tb testing.TB, topic string) (*Source, []string) {
	tb.Helper()
	broker, err := devstack.StartKafka(devstack.KafkaOptions{})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(broker.Stop)
	source, err := New(broker.Brokers, runtime.KafkaSecurity{}, slog.New(slog.DiscardHandler))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(source.Close)
	created, err := source.client.CreateTopics(context.Background(), &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: 1, ReplicationFactor: 1}}})
	if err == nil {
		err = created.Errors[topic]
	}
	if err != nil {
		tb.Fatal(err)
	}
	return source, broker.Brokers
}
