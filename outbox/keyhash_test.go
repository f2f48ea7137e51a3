package outbox

import (
	"hash/fnv"
	"strings"
	"testing"
)

// The key hash stays FNV-1a 32 (stored shards depend on it), and lanes use
// the same hash.
func TestKeyHashIsFNV1a(t *testing.T) {
	for _, k := range []string{"", "a", "key-07", "\x00\xff binary", strings.Repeat("long", 100)} {
		h := fnv.New32a()
		h.Write([]byte(k))
		if got, want := ShardOf(k), int(h.Sum32()%Shards); got != want {
			t.Errorf("ShardOf(%q) = %d, want %d", k, got, want)
		}
		if got, want := LaneOf([]byte(k), 7), int(h.Sum32()%7); got != want {
			t.Errorf("LaneOf(%q, 7) = %d, want %d", k, got, want)
		}
		if got := LaneOf([]byte(k), 1); got != 0 {
			t.Errorf("LaneOf(%q, 1) = %d, want 0", k, got)
		}
	}
}
