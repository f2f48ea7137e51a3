// Package monitoring holds the check that kfn's Grafana dashboard
// (deploy/grafana) and alert rules (deploy/kubernetes/base/alerts.yaml)
// query only metrics that kfn exports: its test runs a real worker and a
// relay (as the Kubernetes base does) against Postgres, NATS and Kafka,
// scrapes their /metrics and compares. It is in the deploy module, which
// may depend on the Prometheus module (for its PromQL parser) and on kfn's
// main module, so that neither dependency reaches kfn's users.
package monitoring
