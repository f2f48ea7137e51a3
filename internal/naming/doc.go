// Package naming owns the names that the engine and the operator tools
// (kfn status, replay, verify) must agree on, so that a tool finds what a
// worker made: the lease groups and items of a function's lanes and of the
// relay shards, scoped by the installation id; the durable JetStream
// consumer of a NATS-triggered function's lane; and the id and key of a
// JetStream event, by which a lane keys its event inbox and chooses its
// lane. It imports nothing of the engine (only outbox, which owns the
// header names an event's key travels in, and pgdata), so the operator
// tools can name a lane without importing the worker.
//
// It is internal to kfn and not a stable API.
package naming
