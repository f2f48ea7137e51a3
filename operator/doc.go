// Package operator is what an operator does to a running installation, by
// hand: read the state of every partition (Status), move a partition's
// cursor back (Replay) and dead-letter a record that keeps a lane from
// moving (Park). Each change goes through the workers' own lease and fence
// (a new, larger token), so a worker that owns the partition is fenced, not
// raced, and each is written to kfn.audit_log in the same transaction.
//
// It also reads and deletes dead letters (ListDeadLetters, ShowDeadLetter,
// DiscardDeadLetters, PurgeDeadLetters): a deletion needs no fence, since
// the records stay handled in the inbox, and is audited in the deletion's
// transaction. AuditLog reads kfn.audit_log. For triage it groups dead
// letters by function, reason and error fingerprint (DeadLetterGroups),
// lists parked keys (ParkedKeys) and reads the relay's backlog
// (ReadRelayBacklog). The kfn CLI (kfn status, kfn replay, kfn dlq, kfn
// audit) and the web console (kfn console) are built on it.
package operator
