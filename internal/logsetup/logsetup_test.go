package logsetup

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"testing"
	"time"
)

// A duration in a JSON log line is a string ("1.5s"), at the top level, in
// an attribute set with With and inside a group; other values keep their
// JSON types.
func TestLogWritesDurationsAsText(t *testing.T) {
	var buf bytes.Buffer
	log := New(&buf, slog.LevelInfo).With("ttl", 5*time.Second)
	log.Info("lease manager starting", "renew_every", 1500*time.Millisecond, "partition", 3,
		slog.Group("retry", "in", 250*time.Microsecond))
	var line map[string]any
	if err := json.Unmarshal(buf.Bytes(), &line); err != nil {
		t.Fatalf("not one JSON line: %v\n%s", err, buf.String())
	}
	for key, want := range map[string]string{"ttl": "5s", "renew_every": "1.5s"} {
		if got, ok := line[key].(string); !ok || got != want {
			t.Errorf("%s = %#v, want the string %q", key, line[key], want)
		}
	}
	if got, ok := line["retry"].(map[string]any)["in"].(string); !ok || got != "250µs" {
		t.Errorf("retry.in = %#v, want the string %q", line["retry"], "250µs")
	}
	if got, ok := line["partition"].(float64); !ok || got != 3 {
		t.Errorf("partition = %#v, want the number 3", line["partition"])
	}
}
