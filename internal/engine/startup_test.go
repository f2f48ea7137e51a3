package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/logsetup"
)

// The first commit logs one line with each phase recorded before it, once
// (the first lane to reach a phase gives its span); later commits and
// phases log and record nothing, and whatever waits for the first commit
// (the relay) is let go at it.
func TestFirstCommitIsLoggedOnceWithThePhasesBeforeIt(t *testing.T) {
	var buf bytes.Buffer
	log := logsetup.New(&buf, slog.LevelInfo)
	c := newStartClock()
	c.phase(phasePostgres, c.began)
	c.phase(phasePostgres, time.Now()) // a second lane: ignored
	released := make(chan struct{})
	go func() {
		c.afterFirstCommit(context.Background(), time.Hour)
		close(released)
	}()
	c.committed(log, time.Now())
	c.committed(log, time.Now())
	c.phase(phaseFence, c.began) // after the first commit: ignored
	select {
	case <-released:
	case <-time.After(10 * time.Second):
		t.Fatal("afterFirstCommit did not return at the first commit")
	}
	lines := bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n"))
	if len(lines) != 1 {
		t.Fatalf("%d lines logged, want 1:\n%s", len(lines), buf.String())
	}
	var line struct {
		Msg    string                       `json:"msg"`
		After  string                       `json:"after"`
		Phases map[string]map[string]string `json:"phases"`
	}
	if err := json.Unmarshal(lines[0], &line); err != nil {
		t.Fatal(err)
	}
	if line.Msg != FirstCommitMsg || len(line.Phases) != 2 || line.Phases[phasePostgres]["from"] != "0s" || line.Phases[phaseCommit]["to"] == "" {
		t.Errorf("logged %s; want %q with the phases postgres (from 0s) and commit only", lines[0], FirstCommitMsg)
	}
	if _, err := time.ParseDuration(line.After); err != nil {
		t.Errorf("after %q: %v", line.After, err)
	}
}
