// Package systemtest holds kfn's end-to-end tests: the two example
// functions (functions/orders and functions/ledger) deployed as real
// processes against real Kafka, Postgres and NATS, chained through the
// outbox relay and JetStream, and faulted (workers killed, events
// republished after the duplicate window, lanes taken over, functions
// started together). They check what no single package owns: that the
// whole chain applies each order exactly once. Behind the container build
// tag, the orders image runs as podman containers that are killed and
// stopped under load (go tool task container:faults). The package has no
// code of its own; the examples' own unit tests live next to them.
package systemtest
