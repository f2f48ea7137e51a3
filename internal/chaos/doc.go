// Package chaos owns kfn's chaos run (go tool task chaos): the fault matrix
// of issue 13 played against real processes (a 3-node NATS cluster with
// kfn's state at 3 replicas, Postgres, Kafka, several worker processes of
// the orders → ledger chain, the orders workers with 4 key-lanes per
// partition, and two relay processes) under continuous load,
// with `kfn verify` judging the end state after every fault. Its test,
// TestChaos, is behind the build tag chaos; flags after -args set its
// duration, its intensity and where its table is written as JSON.
package chaos
