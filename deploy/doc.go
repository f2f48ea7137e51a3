// Package deploy owns kfn's deployment files and their validation: the
// images (Containerfile, Containerfile.scratch, image.sh), the compose
// stack (compose/), the Kubernetes kustomize base and example overlay with
// KEDA, scraping and alert rules (kubernetes/), the Grafana dashboard
// (grafana/), the alert rules' promtool tests (alerts_test.yaml), and the
// tests that render and load them offline,
// decode every object strictly into the real Kubernetes and compose types,
// and check that every setting, flag, port and probe path they name exists
// in the kfn binaries. It is a module of its own (deploy/go.mod), so that
// the Kubernetes and compose libraries never reach kfn's main module.
package deploy
