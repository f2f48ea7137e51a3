// Package observe owns what a worker tells about itself: its live
// counters (Stats, per lane and per function, with the latency
// histograms), the Prometheus collectors and the /metrics, /healthz and
// /readyz handler (Registry, Handler), the readiness probe a function
// binary's --healthcheck runs (ProbeReady), whether the worker reaches
// Postgres (PGHealth, the lease managers' health hook) with the deadline
// of every Postgres round trip (LimitPostgres), and the span helpers that
// need no lane (a record's trace context, EndSpan). It reads the engine
// through Sources and never imports it. It is not a stable API.
package observe
