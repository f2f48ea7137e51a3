package engine

import "testing"

func TestShardItemsRoundTrip(t *testing.T) {
	items := shardItems()
	for want, item := range items {
		got, err := parseShardItem(item)
		if err != nil || got != want {
			t.Errorf("parseShardItem(%q) = %d, %v; want %d", item, got, err, want)
		}
	}
	for _, bad := range []string{"", "shard-", "shard-x", "7", "shard--1", "shard-999", "Shard-01"} {
		if _, err := parseShardItem(bad); err == nil {
			t.Errorf("parseShardItem(%q) accepted it", bad)
		}
	}
}
