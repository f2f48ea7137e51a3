package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// kfn relay logs like the workers: JSON lines on stderr, from the level of
// --log-level or KFN_LOG_LEVEL up.
func TestRelayLogsJSONLikeTheWorkers(t *testing.T) {
	db := kfntest.Postgres(t)
	natsURL := kfntest.NATSURL(t)
	relay := func(env string, extra ...string) []string {
		t.Helper()
		t.Setenv("KFN_LOG_LEVEL", env)
		ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
		defer cancel()
		var out, errOut bytes.Buffer
		args := append([]string{"relay", "--database-url", db.URL, "--nats-url", natsURL, "--subjects", kfntest.Name(t, "logs") + ".x",
			"--event-stream", kfntest.Name(t, "LOGS"), "--lease-bucket", kfntest.Name(t, "leases"), "--stats-every", "1h"}, extra...)
		if code := run(ctx, args, &out, &errOut); code != 0 {
			t.Fatalf("kfn relay: exit %d\n%s", code, errOut.String())
		}
		var lines []string
		for _, line := range strings.Split(strings.TrimSpace(errOut.String()), "\n") {
			if line != "" {
				lines = append(lines, line)
			}
		}
		return lines
	}
	lines := relay("debug")
	if len(lines) == 0 {
		t.Fatal("KFN_LOG_LEVEL=debug: no log line")
	}
	for _, line := range lines {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil || rec["level"] == nil || rec["msg"] == nil {
			t.Errorf("not a JSON log line with level and msg: %q", line)
		}
	}
	if lines := relay("debug", "--log-level", "error"); len(lines) != 0 {
		t.Errorf("--log-level error over KFN_LOG_LEVEL=debug: %d lines, first %q", len(lines), lines[0])
	}
}
