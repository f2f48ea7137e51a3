package engine

import (
	"testing"

	kfn "github.com/kfn-dev/kfn/runtime"
)

// TestExpired: a gap in what a lane read is an expiry only when its cursor
// is below Kafka's first offset; compaction leaves gaps above it. The
// records read before the expiry are applied before the skip, and a gap
// below the first offset is always skipped through the audit.
func TestExpired(t *testing.T) {
	cases := []struct {
		name        string
		next, first int64
		offsets     []int64
		cut         int
		to          int64
	}{
		{"legitimate gap before the batch", 10, 3, []int64{15, 16}, 2, 10},
		{"legitimate gap inside the batch", 10, 3, []int64{10, 12}, 2, 10},
		{"legitimate gap, the cursor at the first offset", 10, 10, []int64{15}, 1, 10},
		{"expired up to the first record read", 10, 15, []int64{15, 16}, 0, 15},
		{"expired, and more after the read", 10, 20, []int64{15, 16}, 0, 15},
		{"expired, then a legitimate gap", 10, 12, []int64{15}, 0, 12},
		{"expired inside the batch: its head first", 10, 25, []int64{10, 11, 25, 26}, 2, 10},
		{"a gap below the first offset ends the head", 10, 25, []int64{10, 12, 25}, 1, 10},
		{"read before everything after it expired", 10, 25, []int64{10, 11}, 2, 10},
	}
	for _, c := range cases {
		batch := make([]kfn.Record, len(c.offsets))
		for i, o := range c.offsets {
			batch[i].Offset = o
		}
		if cut, to := expired(batch, c.next, c.first); cut != c.cut || to != c.to {
			t.Errorf("%s: expired(%v, next %d, first %d) = %d, %d; want %d, %d", c.name, c.offsets, c.next, c.first, cut, to, c.cut, c.to)
		}
	}
	next := (&partitionTracker{}).cursorAfter
	if !gapped([]kfn.Record{{Offset: 11}}, 10, next) || !gapped([]kfn.Record{{Offset: 10}, {Offset: 12}}, 10, next) || gapped([]kfn.Record{{Offset: 10}, {Offset: 11}}, 10, next) {
		t.Error("gapped misses a gap or sees one in contiguous offsets")
	}
	// A marker at 11 that the reader passed is no gap.
	passed := (&partitionTracker{afters: map[int64]int64{10: 12}}).cursorAfter
	if gapped([]kfn.Record{{Offset: 10}, {Offset: 12}}, 10, passed) || !gapped([]kfn.Record{{Offset: 10}, {Offset: 13}}, 10, passed) {
		t.Error("gapped sees a gap over offsets the reader passed, or misses one past them")
	}
}
