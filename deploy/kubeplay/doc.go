// Package kubeplay holds the test that runs kfn's Kubernetes example for
// real: it renders deploy/kubernetes/overlays/example with kustomize (in
// process, as the deploy tests do), rewrites what a single podman host
// needs (local images, the local Postgres, NATS and Kafka on the host
// network, and what podman 4.3 cannot take as rendered), and plays it
// with `podman --runtime runc kube play --network host`. It checks the
// pods' readiness through their rendered probes, exactly-once under a
// forced pod deletion and a graceful pod stop, and the lease takeover
// times against the TTL. The test file's comment lists each rewrite and
// why. It needs podman, so it is behind the container build tag
// (go tool task container:kubeplay; CI runs it).
package kubeplay
