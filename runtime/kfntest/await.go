package kfntest

import (
	"testing"
	"time"
)

// Await polls cond every 50 ms until it holds and returns true, logging
// cond's reason every 10 s while it does not. After limit it reports a
// test error with cond's last reason and returns false, so the caller can
// add what it knows before it stops the test.
func Await(t testing.TB, limit time.Duration, what string, cond func() (bool, string)) bool {
	t.Helper()
	deadline := time.Now().Add(limit)
	lastLog := time.Now()
	for {
		ok, why := cond()
		if ok {
			return true
		}
		if time.Since(lastLog) >= 10*time.Second {
			t.Logf("waiting for %s: %s", what, why)
			lastLog = time.Now()
		}
		if time.Now().After(deadline) {
			t.Errorf("timed out after %s waiting for %s: %s", limit, what, why)
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
}
