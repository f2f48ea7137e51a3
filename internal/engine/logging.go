package engine

import (
	"io"
	"log/slog"
)

// newLogger is the logger of a function process: JSON lines on w from
// level up. Durations are written as text ("1.5s", as time.Duration prints
// them), not as slog's JSON default of integer nanoseconds, so that a
// reader of the log (or a log pipeline) sees the unit.
func newLogger(w io.Writer, level slog.Level) *slog.Logger {
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level, ReplaceAttr: durationAsText}))
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
