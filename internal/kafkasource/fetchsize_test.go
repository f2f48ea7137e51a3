package kafkasource

import (
	"context"
	"fmt"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
)

// A reader holds about two batches of records ahead of its lane, not a
// whole 1 MiB response: with 80-byte records and batches of 500 (the
// default), a response holds about 1,000 records plus one producer batch
// (16 KiB uncompressed, as the Java producer's batch.size), where a fetch of the bound
// holds about 10,000. Without a batch size it fetches up to the bound.
func TestAReaderFetchesAboutTwoBatchesAhead(t *testing.T) {
	const records = 20000
	source, brokers := onePartitionTopic(t, "sized")
	ctx := context.Background()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.DefaultProduceTopic("sized"),
		kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.ProducerBatchMaxBytes(16<<10), kgo.ProducerBatchCompression(kgo.NoCompression()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	for i := range records {
		cl.Produce(ctx, &kgo.Record{Key: fmt.Appendf(nil, "k%d", i), Value: fmt.Appendf(nil, "%080d", i)}, func(_ *kgo.Record, err error) {
			if err != nil {
				t.Error(err)
			}
		})
	}
	if err := cl.Flush(ctx); err != nil {
		t.Fatal(err)
	}

	// held reads n records with a reader of source and returns the most
	// records it held read but not handed on.
	held := func(n int) int {
		r, err := source.Reader("sized", 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		most := 0
		for i := range n {
			rec, _, err := r.NextRecord(ctx)
			if err != nil || rec.Offset != int64(i) {
				t.Fatalf("record %d: offset %d, %v", i, rec.Offset, err)
			}
			most = max(most, len(r.buffered)+1)
		}
		return most
	}
	source.BatchRecords = 500
	if got, limit := held(records), 2*500+200; got > limit {
		t.Errorf("with batches of 500 records, the reader held up to %d records ahead, over %d (two batches and a producer batch)", got, limit)
	} else {
		t.Logf("with batches of 500 records, the reader held up to %d records ahead", got)
	}
	source.BatchRecords = 0
	if got := held(records); got < 5000 {
		t.Errorf("without a batch size, the reader held up to %d records ahead; want a response of the 1 MiB bound (over 5,000)", got)
	} else {
		t.Logf("without a batch size, the reader held up to %d records ahead", got)
	}
}
