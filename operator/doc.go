// Package operator is what an operator does to a running installation, by
// hand: read the state of every partition (Status), move a partition's
// cursor back (Replay) and dead-letter a record that keeps a lane from
// moving (Park). Each change goes through the workers' own lease and fence
// (a new, larger token), so a worker that owns the partition is fenced, not
// raced, and each is written to kfn.audit_log in the same transaction. The
// kfn CLI (kfn status, kfn replay, kfn dlq park) is built on it.
package operator
