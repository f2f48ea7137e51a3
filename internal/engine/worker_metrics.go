package engine

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kfn-dev/kfn/internal/observe"
)

// HTTPHandler serves the worker's Prometheus metrics at /metrics, a liveness
// check at /healthz (the process serves HTTP) and a readiness check at
// /readyz (Postgres with a compatible schema, NATS JetStream and Kafka
// answer, and every consumed topic exists; probed every 2 s).
func (wk *Worker) HTTPHandler() http.Handler {
	return wk.w.httpHandler(wk.w.serveReadiness)
}

func (w *worker) httpHandler(readyz http.HandlerFunc) http.Handler {
	reg, _ := w.registry() // NewWorker returned its error: none here
	return observe.Handler(reg, readyz)
}

// registry is what /metrics serves (observe.Registry), read from this
// worker.
func (w *worker) registry() (*prometheus.Registry, error) {
	src := observe.Sources{
		WorkerID:     w.cfg.WorkerID,
		Functions:    w.fns,
		StallAfter:   w.cfg.StallAfter,
		Stats:        w.stats,
		Pool:         w.pool,
		Ready:        w.ready.state,
		TopicMissing: w.ready.topicMissing,
		Relay:        (&Worker{w: w}).RelayStats,
	}
	if w.offsets != nil {
		src.Mirror = w.offsets.State
	}
	return observe.Registry(src)
}
