// Package verify owns kfn verify: the read-only reconciliation of one
// Kafka-triggered function against a deployment. It compares every record
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
//   - fenced_but_committed: an inbox row committed by an epoch that never
//     claimed the partition, or by an epoch older than one that had already
//     committed a lower offset of the partition (the inbox keeps each row's
//     epoch, not its commit order: a stale commit that no newer owner had
//     overtaken yet looks like a clean handoff, and only a checker that
//     records commit order, like the fault tests', can tell);
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
// cursor on are pending, not checked. A worker publishes an event only after
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
// Memory: the records, the inbox rows, the dead letters and per-record
// effects are merged as ordered streams, one partition at a time. What is
// held is one small entry per stream event of the function (its source,
// a hash of its id), one per key for the counting shapes and the order
// check, and the claim history.
package verify
