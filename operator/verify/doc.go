// Package verify owns kfn verify: the read-only reconciliation of one
// function against a deployment, Kafka-triggered or NATS-triggered (see
// "NATS-triggered functions" below). It compares every record
// Kafka holds below the function's cursors with what Postgres and JetStream
// say happened to it, and reports six kinds of violation, each with a count
// and a few examples:
//
//   - lost: a record below the cursor with neither an effect nor a dead
//     letter (with no effects query: neither an inbox row nor a dead letter);
//   - duplicated: a record with more than one effect, or with an effect and
//     a dead letter; an event id stored twice in the stream, or a second
//     event for one record under an id kfn did not derive for it;
//   - unexpected: an effect, inbox row or event whose record Kafka does not
//     hold below the cursor, or which was dead-lettered;
//   - fenced_but_committed: an inbox row committed by an epoch older than
//     a claim that had already found the partition's cursor at or below its
//     offset (each claim's audit row records the cursor it found: from
//     there on the partition was the newer epoch's), or by an epoch that
//     never claimed the partition;
//   - unpublished: an outbox row of the function older than a threshold;
//   - out_of_order: two events of one key in the stream, in the order
//     opposite to their records' offsets in one partition.
//
// # The consistent cut
//
// Run reads the event stream's last sequence first, then takes one
// REPEATABLE READ snapshot of Postgres and reads everything there from it,
// then asks Kafka for each partition's first offset and high watermark.
// A record is checked when it lies below its partition's cursor in that
// snapshot (the larger of next_offset and high_water: an idempotent replay
// moves next_offset back over records that stay handled); records from the
// cursor on are pending, not checked. A partition run as key-lanes
// (KeyConcurrency > 1, a kfn.key_lanes row) has records above its cursor
// that a key-lane committed: those that Postgres shows handled are checked
// as the records below it, and the others are pending. A worker publishes an event only after
// its transaction committed, so every event up to the stream's last sequence
// comes from a transaction the snapshot sees. The cut is stated in the
// report, so a run against a deployment under load is exact below it.
//
// # Effects
//
// The business effects come from a query the user supplies, in one of
// three shapes, told apart by its number of columns:
//
//   - (source_topic, source_partition, source_offset): one row per applied
//     record, the exact check;
//   - (key, count): per Kafka record key, how many records changed it
//     (orders: SELECT order_id, revisions FROM orders), compared with the
//     number of applied records of each key;
//   - (count): one total, compared with the number of applied records.
//
// A re-execution (kfn replay --reexecute, audited) applies its records
// again on purpose: each one it covered may have one more effect, and its
// events may be in the stream again. It lowers the high-water mark, but the
// records below the old one stay checked.
//
// The counting shapes need Kafka to hold every record from offset 0. With
// no query the inbox is the evidence of an applied record, which holds
// only within the inbox retention.
//
// # NATS-triggered functions
//
// For a function whose source is a NATS subject (it has a kfn.subject_lanes
// row or event inbox rows on it), Run reads the snapshot first and then
// every event on the subject in the event stream up to its last sequence,
// so that every lane's cursor is at or below it. An event is checked when
// its stream sequence lies below the cursor of its lane (outbox.LaneOf of
// its key over the current lane count); its id is its Nats-Msg-Id, as the
// worker's event inbox keys it. Copies of an event (republished past the
// duplicate window) are one event: the inbox skips them. The event inbox,
// which holds dead-lettered events too, and the effects are read in event
// id order and merged with the events sorted by id:
//
//   - lost: an event below its lane's cursor with no effect (no event
//     inbox row without a query) and not dead-lettered;
//   - duplicated: an event with more than one effect, or a dead-lettered
//     one with an effect;
//   - unexpected: an event inbox row or effect for an id the stream does
//     not hold (rows of events below the stream's first sequence are not
//     compared);
//   - fenced_but_committed: an event inbox row whose epoch is older than a
//     claim of its lane that found the cursor at or below its sequence
//     (rows committed before the last change of the lane count are left
//     out: their lanes were others);
//   - unpublished: as for a Kafka-triggered function.
//
// The same read of the stream finds the function's own events (those the
// relay published for it, with the subject as their source topic); the
// source of each is the event on the subject at its source offset (a
// stream sequence), and its lane is the source's. They are checked as a
// Kafka-triggered function's events are, with the source event in place
// of the record:
//
//   - duplicated: an event id stored twice, or a second event for one
//     source event under an id kfn did not derive for it (outbox.EventID
//     of "event/" and the source's id);
//   - unexpected: an event whose source offset holds no event on the
//     subject, or whose source event below its lane's cursor was not
//     handled or was dead-lettered (those of pending source events may
//     come from transactions after the snapshot: not compared);
//   - out_of_order: two events of one key (and lane) in the stream, in the
//     order opposite to their source events' stream sequences.
//
// The effects query's per-record shape is then (event_id); (key, count)
// counts per event key, and the counting shapes need the stream to hold
// the subject from sequence 1. What is held is one entry per event on the
// subject (its id, sequence and lane, and its key for the keyed shape),
// and one small entry per event of the function, as above.
//
// # A range
//
// Spec.Partitions, From and To restrict a Kafka-triggered function's run
// to the offsets [From, To) of some partitions; a time bound is each
// partition's first offset whose record's timestamp is at or after it
// (Kafka's time index, ListOffsets). The range is clipped to what Kafka
// holds and to the cursor as above, and every stream is read within it:
// the inbox (an index range per lane), the dead letters, the per-record
// effects, the outbox rows and the events in the stream (by their source
// record), so nothing outside it is compared. The counting shapes compare
// totals that a range cannot split, and the WAL outbox slot's backlog is
// the whole database's: a range refuses the first and leaves out the
// second, with a note. The cut states the range and, per partition, the
// offsets checked. A NATS-triggered function takes no range.
//
// Memory: the records, the inbox rows, the dead letters and per-record
// effects are merged as ordered streams, one partition at a time; Postgres
// reads them over one exported snapshot, on a connection each. What is
// held is one small entry per stream event of the function (its source
// record, hashes of its id and key; sorted by key for the order check,
// then by record for the merge), one per key for the (key, count) shape,
// and the audit history of the topic's partitions.
package verify
