// Package monitoring holds the check that kfn's Grafana dashboard
// (deploy/grafana) and alert rules (deploy/kubernetes/base/alerts.yaml)
// query only metrics that kfn exports: its test runs a real worker (with
// its relay) against Postgres, NATS and Kafka, scrapes its /metrics and
// compares. It is in the deploy module, which may depend on the Prometheus
// module (for its PromQL parser) and on kfn's main module, so neither
// dependency reaches kfn's users.
package monitoring
