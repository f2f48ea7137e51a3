package bench

import (
	"fmt"
	"strings"
	"testing"
)

// The limits sweep batch sizes 500 to 5,000 and 1 to twice the
// partitions' connections, the partitions' count and twice it included.
func TestLimitSettingsSweepBatchesAndUpToTwiceThePartitionsConnections(t *testing.T) {
	for _, c := range []struct {
		partitions int
		want       string
	}{
		{1, "[{500 1} {500 2} {1000 1} {1000 2} {2000 1} {2000 2} {5000 1} {5000 2}]"},
		{3, "[{500 1} {500 2} {500 3} {500 4} {500 6} {1000 1} {1000 2} {1000 3} {1000 4} {1000 6} {2000 1} {2000 2} {2000 3} {2000 4} {2000 6} {5000 1} {5000 2} {5000 3} {5000 4} {5000 6}]"},
		{4, "[{500 1} {500 2} {500 4} {500 8} {1000 1} {1000 2} {1000 4} {1000 8} {2000 1} {2000 2} {2000 4} {2000 8} {5000 1} {5000 2} {5000 4} {5000 8}]"},
	} {
		var got []string
		for _, s := range limitSettings(c.partitions) {
			got = append(got, fmt.Sprintf("{%d %d}", s.Batch, s.Connections))
		}
		if got := "[" + strings.Join(got, " ") + "]"; got != c.want {
			t.Errorf("limitSettings(%d) = %s, want %s", c.partitions, got, c.want)
		}
	}
}
