package engine

import "testing"

// TestExpiredUntil: a gap between the cursor and the batch read is a skip
// of expired records only when the cursor is below Kafka's first offset;
// compaction and transaction markers leave gaps above it.
func TestExpiredUntil(t *testing.T) {
	cases := []struct {
		name              string
		next, read, first int64
		want              int64
	}{
		{"legitimate gap: compaction or transaction markers", 10, 15, 3, 10},
		{"legitimate gap at the first offset", 10, 15, 10, 10},
		{"expired up to the first offset read", 10, 15, 15, 15},
		{"expired, and more expired after the read", 10, 15, 20, 15},
		{"expired, then a legitimate gap", 10, 15, 12, 12},
	}
	for _, c := range cases {
		if got := expiredUntil(c.next, c.read, c.first); got != c.want {
			t.Errorf("%s: expiredUntil(next %d, read %d, first %d) = %d, want %d", c.name, c.next, c.read, c.first, got, c.want)
		}
	}
}
