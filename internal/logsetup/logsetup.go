// Package logsetup makes the logger of every long-running kfn process (a
// function's worker, kfn relay): JSON lines from a level up, set by
// --log-level / KFN_LOG_LEVEL (settings.LogLevel), with durations as
// text. It owns that format and nothing else.
package logsetup

import (
	"io"
	"log/slog"
)

// New is the logger of a kfn process: JSON lines on w from level up.
// Durations are written as text ("1.5s", as time.Duration prints them),
// not as slog's JSON default of integer nanoseconds, so that a reader of
// the log (or a log pipeline) sees the unit.
func New(w io.Writer, level slog.Level) *slog.Logger {
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level, ReplaceAttr: durationAsText}))
}

// Level reads a level as settings.LogLevel takes it (debug, info, warn,
// error); a value it refuses is info (settings.LogLevel has reported it).
func Level(s string) slog.Level {
	var level slog.Level
	_ = level.UnmarshalText([]byte(s))
	return level
}

// durationAsText is a slog ReplaceAttr that writes a duration as its
// String form. The handler calls it for every attribute, nested in groups
// or not, after resolving LogValuers.
func durationAsText(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		return slog.String(a.Key, a.Value.Duration().String())
	}
	return a
}
