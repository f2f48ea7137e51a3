package kafkasource

import (
	"errors"
	"log/slog"
	"testing"
	"time"
)

// TestFailedOffsetCommitsAreRetried: a mirror commit that failed goes back
// to the pending offsets, unless a newer offset was noted meanwhile, so the
// group catches up even when its partitions receive nothing more.
func TestFailedOffsetCommitsAreRetried(t *testing.T) {
	c := NewGroupMirror(nil, slog.New(slog.DiscardHandler))
	k := groupTopic{"g", "t"}
	c.Note("g", "t", 1, 50) // noted after the failed flush took its batch
	c.requeue(k, map[int]int64{0: 120, 1: 40}, errors.New("coordinator load in progress"))
	if got := c.pending[k]; got[0] != 120 || got[1] != 50 {
		t.Errorf("pending after a failed commit = %v, want partition 0 at 120 (requeued) and 1 at 50 (the newer note)", got)
	}
	c.requeue(groupTopic{"g", "u"}, map[int]int64{0: 7}, nil)
	if _, ok := c.pending[groupTopic{"g", "u"}]; ok {
		t.Error("a commit that succeeded was requeued")
	}
}

// A repeated warning passes once per interval per key; the next one that
// passes carries the count of those held back.
func TestWarnLimiterPassesOncePerIntervalAndCountsTheRest(t *testing.T) {
	now := time.Unix(1000, 0)
	l := newWarnLimiter(30*time.Second, func() time.Time { return now })
	steps := []struct {
		advance  time.Duration
		key      string
		wantOK   bool
		wantHeld int
	}{
		{0, "g/t", true, 0},
		{time.Second, "g/t", false, 0},
		{time.Second, "g/u", true, 0}, // another key has its own interval
		{10 * time.Second, "g/t", false, 0},
		{17 * time.Second, "g/t", false, 0}, // 29 s after the first
		{time.Second, "g/t", true, 3},       // 30 s: passes, with the 3 held back
		{time.Second, "g/t", false, 0},
		{40 * time.Second, "g/t", true, 1},
	}
	for i, s := range steps {
		now = now.Add(s.advance)
		if ok, held := l.allow(s.key); ok != s.wantOK || held != s.wantHeld {
			t.Errorf("step %d (%s): allow = %v, %d held; want %v, %d", i, s.key, ok, held, s.wantOK, s.wantHeld)
		}
	}
}
