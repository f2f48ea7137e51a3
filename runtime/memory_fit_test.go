package runtime_test

import (
	"bytes"
	"context"
	"log/slog"
	"math"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// A worker whose lanes cannot fit its Go memory limit says so at start,
// naming the flags that bound a lane; one whose lanes fit says nothing.
// The limit is this test process's (as GOMEMLIMIT or a container's would
// set it); the topic has 8 partitions, each lane up to two batches of
// --batch-max-bytes and a fetch.
func TestAWorkerSaysWhenItsLanesCannotFitItsMemoryLimit(t *testing.T) {
	b := setup(t, 8)
	before := debug.SetMemoryLimit(256 << 20)
	defer debug.SetMemoryLimit(before)
	if before != math.MaxInt64 {
		t.Logf("the test process had a memory limit of %d bytes; restored after", before)
	}
	for _, tc := range []struct {
		batchMaxBytes int
		warned        bool
	}{
		{batchMaxBytes: 64 << 20, warned: true}, // 8 × (2 × 64.5 MiB + 2 MiB) > 256 MiB
		{batchMaxBytes: 4 << 20, warned: false}, // 8 × (2 × 4.5 MiB + 2 MiB) + 32 MiB = 120 MiB
	} {
		var logs bytes.Buffer
		cfg := b.cfg
		cfg.BatchMaxBytes = tc.batchMaxBytes
		cfg.Logger = slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
		w, err := worker.New(context.Background(), cfg, effects.Function(b.fn, b.topic))
		if err != nil {
			t.Fatal(err)
		}
		w.Close()
		var line string
		for l := range strings.Lines(logs.String()) {
			if strings.Contains(l, `"msg":"memory: `) {
				line = l
			}
		}
		switch {
		case tc.warned && (line == "" || !strings.Contains(line, "8 lanes") || !strings.Contains(line, "--batch-max-bytes (KFN_BATCH_MAX_BYTES)") || !strings.Contains(line, "--max-record-bytes (KFN_MAX_RECORD_BYTES)") || !strings.Contains(line, "256 MiB")):
			t.Errorf("--batch-max-bytes %d under a 256 MiB limit: warning %q; want one naming the 8 lanes, the limit and both flags with their variables\n%s", tc.batchMaxBytes, line, logs.String())
		case !tc.warned && line != "":
			t.Errorf("--batch-max-bytes %d under a 256 MiB limit: warned %q, and the lanes fit", tc.batchMaxBytes, line)
		}
	}
}
