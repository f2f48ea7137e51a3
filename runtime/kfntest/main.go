package kfntest

import (
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
)

// mainRunning is set by Main. Shared services that outlive a single test
// (a Postgres cluster, built binaries, servers) refuse to start without it,
// because nothing else would stop or remove them.
var mainRunning atomic.Bool

// shared holds the stop functions of lazily started shared services.
var shared struct {
	mu    sync.Mutex
	stops []func()
}

// Main runs the tests, stops every shared service this package started and
// exits with the tests' exit code. Call it from TestMain.
func Main(m *testing.M) {
	mainRunning.Store(true)
	code := m.Run()
	stopShared()
	os.Exit(code)
}

// onShutdown registers fn to run when Main finishes, in reverse order.
func onShutdown(fn func()) {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	shared.stops = append(shared.stops, fn)
}

func stopShared() {
	shared.mu.Lock()
	stops := shared.stops
	shared.stops = nil
	shared.mu.Unlock()
	for i := len(stops) - 1; i >= 0; i-- {
		stops[i]()
	}
}

// requireMain fails the test when the package's TestMain does not call Main.
func requireMain(t testing.TB, what string) {
	t.Helper()
	if !mainRunning.Load() {
		t.Fatalf("kfntest: %s starts a service shared by the whole test binary, and only kfntest.Main stops it; "+
			"add this to the package's tests:\n\n\tfunc TestMain(m *testing.M) { kfntest.Main(m) }", what)
	}
}

// logger is for the shared services' own logs: warnings and errors to stderr.
var logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

// announce prints a line to stderr so CI logs show which real component ran.
func announce(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "kfntest: "+format+"\n", args...)
}
