package main

import (
	"testing"
	"time"
)

func TestTimeFlagsTakeRFC3339AndDurationsAgo(t *testing.T) {
	now := time.Date(2026, 3, 10, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		in   string
		want time.Time
	}{
		{"", time.Time{}},
		{"2026-03-01T09:00:00Z", time.Date(2026, 3, 1, 9, 0, 0, 0, time.UTC)},
		{"2026-03-01T09:00:00.5+01:00", time.Date(2026, 3, 1, 8, 0, 0, 5e8, time.UTC)},
		{"2h", now.Add(-2 * time.Hour)},
		{"30m", now.Add(-30 * time.Minute)},
		{"7d", now.Add(-7 * 24 * time.Hour)},
		{"1d12h", now.Add(-36 * time.Hour)},
		{"0s", now},
	} {
		got, err := parseTimeValue(tc.in, now)
		if err != nil || !got.Equal(tc.want) {
			t.Errorf("parseTimeValue(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{"yesterday", "-2h", "2", "d", "7dd", "1d-2h", "2026-03-01", "9999999999d"} {
		if got, err := parseTimeValue(bad, now); err == nil {
			t.Errorf("parseTimeValue(%q) = %v, want an error", bad, got)
		}
	}
}

func TestDurationFlagsTakeDays(t *testing.T) {
	for in, want := range map[string]time.Duration{"30d": 30 * 24 * time.Hour, "1d12h": 36 * time.Hour, "90m": 90 * time.Minute} {
		var f agoFlag
		if err := f.Set(in); err != nil || f.d != want {
			t.Errorf("--older-than %s = %v, %v; want %v", in, f.d, err, want)
		}
	}
}
