// Package devstack owns the throwaway infrastructure that `kfn dev` and the
// test harness start on a developer's machine: a PostgreSQL cluster made from
// the local PostgreSQL binaries (StartPostgres), an in-process Kafka-protocol
// broker (StartKafka, backed by franz-go's kfake) and an in-process NATS server
// with JetStream (StartNATS). Everything listens on 127.0.0.1 only, picks free
// ports, keeps its state in a directory it can remove again, and is bounded in
// how long it waits to come up. Nothing here is meant for production.
package devstack
