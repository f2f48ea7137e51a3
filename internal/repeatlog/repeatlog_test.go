package repeatlog

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// A failure retried every 100 ms for 6 s, by eight lanes at once, is
// logged at 0 s, 1 s, 3 s (the steps of 1 s, 2 s, 4 s), each line with the
// count it stands for, and once when it is over: 4 lines for 480 failures.
func TestARetriedFailureIsLoggedOncePerStepWithItsCount(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&buf, nil))
	at := time.Unix(0, 0)
	l := New()
	l.now = func() time.Time { return at }
	ctx := context.Background()
	const msg = "apply batch failed, retrying"
	for tick := 0; tick <= 60; tick++ {
		at = time.Unix(0, 0).Add(time.Duration(tick) * 100 * time.Millisecond)
		for lane := range 8 {
			l.Failed(ctx, log.With("partition", lane), slog.LevelWarn, msg, "err", "connection refused")
		}
	}
	l.Over(ctx, log, msg)

	var got []string
	for line := range strings.Lines(buf.String()) {
		var e struct {
			Msg   string `json:"msg"`
			Level string `json:"level"`
		}
		if err := json.Unmarshal([]byte(line), &e); err != nil {
			t.Fatal(err)
		}
		got = append(got, e.Level+" "+e.Msg)
	}
	want := []string{
		"WARN apply batch failed, retrying",
		"WARN apply batch failed, retrying (repeated 80 times in 1s)",
		"WARN apply batch failed, retrying (repeated 160 times in 2s)",
		"INFO over: apply batch failed, retrying (488 times in 6s)",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("lines:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// A new failure after Over starts a new run, logged at once.
	buf.Reset()
	l.Failed(ctx, log, slog.LevelWarn, msg)
	if buf.Len() == 0 {
		t.Error("the first failure after Over was not logged")
	}
}

// The step doubles up to MaxStep, and a failure that goes on for hours is
// logged once a minute.
func TestTheStepStopsGrowingAtAMinute(t *testing.T) {
	var lines int
	log := slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) { lines++; return len(p), nil }), nil))
	at := time.Unix(0, 0)
	l := New()
	l.now = func() time.Time { return at }
	for s := 0; s <= 3600; s++ {
		at = time.Unix(int64(s), 0)
		l.Failed(context.Background(), log, slog.LevelWarn, "renew failed")
	}
	// 0, 1, 3, 7, 15, 31, 63 s, then every 64 s is not allowed: every 60 s.
	if lines < 60 || lines > 66 {
		t.Errorf("%d lines in an hour of failures every second, want about 7 + 59", lines)
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
