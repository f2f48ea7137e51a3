package engine

import (
	"errors"
	"log/slog"
	"testing"
)

// TestFailedOffsetCommitsAreRetried: a mirror commit that failed goes back
// to the pending offsets, unless a newer offset was noted meanwhile, so the
// group catches up even when its partitions receive nothing more.
func TestFailedOffsetCommitsAreRetried(t *testing.T) {
	c := newOffsetCommitter(nil, slog.New(slog.DiscardHandler))
	k := groupTopic{"g", "t"}
	c.note("g", "t", 1, 50) // noted after the failed flush took its batch
	c.requeue(k, map[int]int64{0: 120, 1: 40}, errors.New("coordinator load in progress"))
	if got := c.pending[k]; got[0] != 120 || got[1] != 50 {
		t.Errorf("pending after a failed commit = %v, want partition 0 at 120 (requeued) and 1 at 50 (the newer note)", got)
	}
	c.requeue(groupTopic{"g", "u"}, map[int]int64{0: 7}, nil)
	if _, ok := c.pending[groupTopic{"g", "u"}]; ok {
		t.Error("a commit that succeeded was requeued")
	}
}
