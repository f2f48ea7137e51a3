package observe

import (
	"io"
	"log/slog"

	"github.com/kfn-dev/kfn/internal/logsetup"
)

// newLogger is the logger of a function process: JSON lines on w from
// level up, durations as text (see package logsetup, which kfn relay
// shares).
func newLogger(w io.Writer, level slog.Level) *slog.Logger {
	return logsetup.New(w, level)
}
