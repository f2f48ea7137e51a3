// Package worker runs kfn functions: as a process of their own (Start, the
// main of a function binary), or inside a program of yours (New, then
// Worker.Run). A worker owns partitions (and NATS subjects) through leases,
// reads them and applies their records exactly once; package runtime holds
// the types it runs.
//
// # Running a function as a process
//
//	func main() { worker.Start(orders.Function) }
//
// Start reads its settings from flags and environment variables (run the
// binary with -h), connects to Kafka, Postgres and NATS, and runs until
// SIGTERM. Run with the argument migrate (`orders migrate --database-url
// …`), the binary applies kfn's schema migrations and the function's Setup
// instead, and exits: run it once as the role that owns the schema, and the
// workers with --skip-setup under a role that has only DML rights (see
// docs/production/postgres.md, "Three roles"). A function deploys as one
// container image; kfn dev runs one locally.
//
// # Running functions inside your program
//
// New takes a runtime.Config (bind it to your flags with Config.Bind, or
// fill it in) and any number of functions; Run runs them until its ctx
// ends, Stats returns the live counters and HTTPHandler serves /metrics,
// /healthz and /readyz.
package worker

import (
	"context"
	"io"
	"net/http"
	"os"

	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/internal/process"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

// Start runs fn as this process's only function: configuration comes from
// flags and environment variables (run the binary with -h to list them),
// and SIGINT or SIGTERM shut it down cleanly. It does not return: it exits
// 0 after a clean shutdown, 2 on bad configuration and 1 when a service
// cannot be used.
func Start(fn runtime.Function) { os.Exit(Main(fn, os.Args[1:], os.Stderr)) }

// Main is Start without the exit, for tests and wrappers: it parses args,
// writes what was asked for (-h, --version, --describe) to stdout, errors
// and logs to stderr, and returns the process's exit code: a bad flag or
// value is one line naming it, and exit 2.
// With the first argument "migrate" it runs the migrate mode instead of a
// worker: kfn's schema migrations and fn's Setup, then exit.
func Main(fn runtime.Function, args []string, stderr io.Writer) int {
	return process.Main(fn, args, os.Stdout, stderr)
}

// Worker runs functions: it owns partitions through leases, reads them and
// applies their records exactly once.
type Worker struct {
	w     *engine.Worker
	stats *Stats
}

// New validates cfg and fns, connects to Postgres, Kafka and NATS, checks
// the schema version and runs each function's Setup (unless
// cfg.SkipSetup). Every failure says which setting or service is at fault;
// a bad setting is an error that names its flag and its variable.
func New(ctx context.Context, cfg runtime.Config, fns ...runtime.Function) (*Worker, error) {
	w, err := engine.NewWorker(ctx, cfg, fns...)
	if err != nil {
		return nil, err
	}
	return &Worker{w: w, stats: newStats(w.Stats())}, nil
}

// Run processes records until ctx ends, then finishes in-flight batches,
// releases its partitions, closes its connections and returns.
func (w *Worker) Run(ctx context.Context) error { return w.w.Run(ctx) }

// Close releases the connections of a worker that will not Run. Run
// releases them itself when it returns.
func (w *Worker) Close() { w.w.Close() }

// Stats returns the worker's live counters.
func (w *Worker) Stats() *Stats { return w.stats }

// RelayStats returns the counters of the worker's outbox relay, and false
// when it runs none (Config.NoRelay, or no function emits).
func (w *Worker) RelayStats() (outbox.RelayStats, bool) { return w.w.RelayStats() }

// HTTPHandler serves the worker's Prometheus metrics at /metrics, a
// liveness check at /healthz (the process serves HTTP) and a readiness
// check at /readyz (Postgres with a compatible schema, NATS JetStream and
// Kafka answer, and every consumed topic exists; probed every 2 s).
func (w *Worker) HTTPHandler() http.Handler { return w.w.HTTPHandler() }
