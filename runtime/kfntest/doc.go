// Package kfntest owns the test harness that kfn's integration tests share: a
// fresh, migrated Postgres database per test, a NATS server, a Kafka cluster
// with topics made to order, unique resource names, binaries built once per
// test binary, a nats-server running as its own process for fault tests, and
// an OTLP/HTTP trace receiver that processes under test export spans to.
//
// Every component has one switch, an environment variable, so the same tests
// run against the embedded components (the default) or real ones:
//
//	KFN_TEST_DATABASE_URL   a Postgres server where the tests may CREATE DATABASE
//	                        (default: a throwaway cluster from the local PostgreSQL
//	                        binaries, one per test binary)
//	KFN_TEST_NATS_URL       a NATS server with JetStream (default: in-process)
//	KFN_TEST_KAFKA_BROKERS  comma-separated Kafka bootstrap brokers (default: an
//	                        in-process kfake broker)
//
// When a variable is set, the first use prints the component's address and
// version (for Kafka: its brokers and API versions) to stderr; run `go test -v`
// in CI so the log keeps that line.
//
// Shared services start lazily, once per test binary, and kfntest.Main stops
// them, so every package that uses this one needs:
//
//	func TestMain(m *testing.M) { kfntest.Main(m) }
//
// Fault tests run real processes with BuildBinary and StartProcess (SIGTERM,
// SIGKILL, SIGSTOP/SIGCONT), a separate nats-server with NATSProcess, or a
// cluster of them with clustered JetStream (NATSClusterProcesses), and a
// real Apache Kafka cluster of JVM processes, replication factor 3, whose
// brokers they kill and start (KafkaClusterProcesses, through
// deploy/local/kafka/kafka.sh; Java and Maven needed, see HaveJava).
// StartSecureNATS runs a nats-server as production does: TLS with a CA the
// test makes, and operator/account/user JWTs (its User writes .creds).
// A process's output goes to a file in the test's temporary directory, or
// in the directory KFN_TEST_PROCESS_LOGS names, where it outlives the test
// (a chaos run's whole story); a failed test logs the file's tail.
// Await polls a condition with a bound and says why it did not hold.
// PostgresProxy puts a TCP proxy in front of Postgres that freezes a path
// (every socket open, nothing forwarded) or cuts off COMMIT replies. On
// Linux every child process dies with the test binary, even when
// `go test -timeout` kills it.
package kfntest
