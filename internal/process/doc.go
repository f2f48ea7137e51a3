// Package process runs a function binary as a process: runtime/worker's
// Start and Main call Main, which parses the flags (every setting, with
// its environment variable), serves --version, --describe (Describe, which
// kfn dev reads), --healthcheck and the migrate mode (kfn's migrations and
// the function's Setup), starts the worker with its metrics server, and
// stops it on SIGINT or SIGTERM with the exit code a supervisor reads. It
// is not a stable API.
package process
