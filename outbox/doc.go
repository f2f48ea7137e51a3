// Package outbox owns the transactional outbox: the events a function emits
// inside its business transaction, their deterministic ids and relay shards,
// and the relay that forwards committed events to NATS JetStream, from
// kfn.outbox rows (ModeTable, see Relay) or from the WAL (ModeWAL).
//
// # WAL outbox
//
// In ModeWAL a transaction writes its events with kfn.emit_events: one
// transactional logical decoding message per event (pg_logical_emit_message,
// prefix WALPrefix), whose payload is a versioned, length-prefixed encoding
// of everything the relay publishes (encodeWALEvent). Postgres decodes the
// messages of a transaction only if it commits, at its commit, and hands
// transactions to a logical replication slot in commit order.
//
// The relay reads the slot (pgoutput, messages 'true') on a replication
// connection. It publishes each event with the message a kfn.outbox row
// would give (same Nats-Msg-Id, subject, headers and data), and it tells
// Postgres how far it may free the slot (the confirmed flush position) only
// up to the end of the last transaction whose events, and every earlier
// transaction's, the stream has acked. A restart, a takeover or a Postgres
// crash (which may lose the last confirmations) resumes from a position at
// or before the oldest unacked event: events after it are published again,
// and dropped by the stream's duplicate window or the downstream inbox.
// Nothing before it is unacked, so nothing is lost.
//
// Per-key order. The slot hands events over in commit order, and the
// relay keeps at most one unacked publish per key, as the shard loops do:
// a key's next event is sent only after the previous one is acked. In-order
// pipelining with ack-before-advance would not be enough. Two publishes of
// one key in flight can be stored out of order when the first fails and the
// second does not: a stream leader change between them, or a rejection of
// the first message alone. Sending the first again would then land it
// after the second. Other keys go on meanwhile, up to MaxPending events
// read and not acked; past that the relay stops reading (and the walsender
// waits), so memory stays bounded. An event the stream keeps refusing is
// never skipped: it holds its key and the slot's position, and is logged at
// error level until it goes through.
//
// One reader per slot. A SlotLease (kfn's workers: one NATS lease in the
// installation's WAL relay group) decides which relay reads the slot, and
// its token fences the slot: before it starts replication the reader
// raises kfn.wal_outbox.fence_token to its token (refused if the fence is
// already higher) on its replication connection's own session, and
// terminates the walsender of the reader it replaces (the pid recorded
// with the fence, and the slot's active_pid). Why a frozen reader that
// wakes after a takeover cannot move the slot past unacked events:
//
//   - A slot's position moves only through the walsender that holds the
//     slot, on that walsender's connection. The old reader's walsender was
//     terminated at the takeover, so its later confirmations go nowhere.
//   - Its only way back is a new replication session, which must first
//     pass the fence with its older token, and cannot.
//   - Even the confirmations it sent before it froze covered only events
//     the stream had acked. The new reader starts at or before them, so
//     they pass nothing unacked.
//   - Publishes it still sends after waking (events it had read) are
//     republications of events with their deterministic ids, and it sends
//     a key's next event only after the previous one was acked.
//
// Slot loss. A slot that is dropped or invalidated loses the events it
// held. The relay reports it (WALStats.SlotLost, kfn.wal_outbox.lost_at,
// an error log), and kfn.emit_events refuses to write events while the
// slot is missing, so that nothing more is lost. SetUpWAL makes the slot
// again and says since when events may be lost; docs/production/wal-outbox.md
// has the recovery.
//
// Retirement. Going back to ModeTable for good, RetireWAL, a drain and
// DropRetiredWAL take the slot away without losing an event (how, in
// wal_retire.go); a relay that then finds no slot stops reading it
// quietly: that is not slot loss.
package outbox
