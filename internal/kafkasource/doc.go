// Package kafkasource owns kfn's side of Kafka: a topic's partitions and
// offset ranges (Source), the reader a lane reads one partition with at
// read_committed (Reader: kfn's own Fetch, which passes over the records of
// aborted transactions and the transaction markers, and says how far it
// passed them so that the lane's cursor can go past them too), the scans
// and look-ups the operator tools make (Log, ReadRecord, OffsetRange), and
// the mirror of the workers' cursors into a Kafka consumer group of kfn's
// own, for lag tools (GroupMirror).
//
// Ownership is not Kafka's business here: NATS leases decide who reads
// which partition, and the Postgres cursor where; nothing in this package
// joins a consumer group. It is not a stable API.
package kafkasource
