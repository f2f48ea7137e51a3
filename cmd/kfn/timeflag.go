package main

import (
	"errors"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// timeFlag is the value of every time flag (--from-time, --since, --until):
// one parser, so each takes the same forms. A value is an RFC 3339 time
// (2026-03-01T09:00:00Z) or a duration before now: Go's units (90m, 2h,
// 1h30m) and d for 24 hours (7d, 1d12h). Unset is the zero time (no
// bound).
type timeFlag struct {
	t   time.Time
	now func() time.Time
}

// timeFormsHelp ends the usage of every time flag.
const timeFormsHelp = "RFC 3339 (2026-03-01T09:00:00Z), or a duration meaning that long ago (90m, 2h, 7d)"

// addTimeFlag adds the time flag name to fs and returns where its value
// will be.
func addTimeFlag(fs *flagSet, name, usage string) *time.Time {
	f := &timeFlag{now: time.Now}
	fs.Var(f, name, usage+": "+timeFormsHelp)
	return &f.t
}

func (f *timeFlag) String() string {
	if f == nil || f.t.IsZero() {
		return ""
	}
	return f.t.Format(time.RFC3339Nano)
}

func (f *timeFlag) Set(s string) error {
	t, err := parseTimeValue(s, f.now())
	if err != nil {
		return err
	}
	f.t = t
	return nil
}

// errNotATime is what a time flag says of a value it cannot read.
var errNotATime = errors.New("neither an RFC 3339 time (2026-03-01T09:00:00Z) nor a duration before now (90m, 2h, 7d)")

// days is a leading count of days in a duration ago ("7d", "1d12h").
var days = regexp.MustCompile(`^([0-9]+)d`)

// parseTimeValue reads a time flag's value relative to now; "" is the zero
// time.
func parseTimeValue(value string, now time.Time) (time.Time, error) {
	value = strings.TrimSpace(value)
	if value == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, value); err == nil {
		return t, nil
	}
	ago, err := parseAgo(value)
	if err != nil {
		return time.Time{}, errNotATime
	}
	return now.Add(-ago), nil
}

// parseAgo reads a duration of 0 or more: Go's units (90m, 2h) and d for
// 24 hours (7d, 1d12h).
func parseAgo(value string) (time.Duration, error) {
	bad := errors.New("not a duration (90m, 2h, 7d)")
	var ago time.Duration
	if m := days.FindStringSubmatch(value); m != nil {
		n, err := strconv.Atoi(m[1])
		if err != nil || n > 100*365 {
			return 0, bad
		}
		ago = time.Duration(n) * 24 * time.Hour
		value = value[len(m[0]):]
		if value == "" {
			return ago, nil
		}
		if value[0] < '0' || value[0] > '9' {
			return 0, bad
		}
	}
	d, err := time.ParseDuration(value)
	if err != nil || d < 0 {
		return 0, bad
	}
	return ago + d, nil
}

// agoFlag is a duration flag that also takes days (--older-than 30d).
type agoFlag struct{ d time.Duration }

func (f *agoFlag) String() string {
	if f == nil || f.d == 0 {
		return ""
	}
	return f.d.String()
}

func (f *agoFlag) Set(s string) (err error) {
	f.d, err = parseAgo(strings.TrimSpace(s))
	return err
}
