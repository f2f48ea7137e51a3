package engine

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kfn-dev/kfn/internal/kafkasource"
	"github.com/kfn-dev/kfn/internal/schema"
)

// readinessEvery is how often a worker probes the services it depends on
// for /readyz, and how long one probe may take.
const readinessEvery = 2 * time.Second

// readiness is the outcome of the worker's last probe of its dependencies:
// Postgres answers with a compatible schema, NATS JetStream answers, Kafka
// answers and every consumed topic exists. /readyz and the kfn_ready and
// kfn_topic_missing gauges read it.
//
// Ready means this worker can do its work now, as seen from this worker:
// a shared service that is down makes every worker not ready alike. That
// is what it should say: a worker cannot tell an outage of the service
// from a fault of its own path to it (a network policy, DNS, one node),
// and kfn's workers take no traffic through a Service, so readiness only
// pauses rollouts and disruptions and raises the not-ready alert. Liveness
// (/healthz) never depends on another service, so an outage restarts no
// worker.
type readiness struct {
	mu       sync.Mutex
	checked  bool
	problems []string        // empty when ready
	missing  map[string]bool // "function\x00topic" → the topic does not exist
}

// state returns the last probe's problems, and whether a probe ran yet.
func (r *readiness) state() (problems []string, checked bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.problems), r.checked
}

// topicMissing reports, per (function, topic), whether the topic was
// missing at the last probe.
func (r *readiness) topicMissing() map[[2]string]bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[[2]string]bool, len(r.missing))
	for k, v := range r.missing {
		fn, topic, _ := strings.Cut(k, "\x00")
		out[[2]string{fn, topic}] = v
	}
	return out
}

// watchReadiness probes the dependencies every readinessEvery until ctx
// ends, and logs each change: a missing topic as an error that says what
// to do, its creation, and the worker turning ready or not ready.
func (w *worker) watchReadiness(ctx context.Context) {
	t := time.NewTicker(readinessEvery)
	defer t.Stop()
	for {
		w.probeReadiness(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (w *worker) probeReadiness(runCtx context.Context) {
	ctx, cancel := context.WithTimeout(runCtx, readinessEvery)
	defer cancel()
	var problems []string
	if err := schema.Check(ctx, w.pool); err != nil {
		problems = append(problems, "postgres: "+err.Error())
	}
	if st := w.nc.Status(); st != nats.CONNECTED {
		problems = append(problems, "nats: connection is "+st.String())
	} else if _, err := w.js.AccountInfo(ctx); err != nil {
		problems = append(problems, "nats: JetStream does not answer: "+err.Error())
	}
	missing := map[string]bool{}
	kafkaDown := false
	if w.kafka != nil {
		if err := w.kafka.Ping(ctx); err != nil {
			problems = append(problems, "kafka: "+err.Error())
			kafkaDown = true // the topics keep their last state
		}
	}
	for _, fn := range w.fns {
		if fn.Topic == "" || kafkaDown {
			continue
		}
		_, err := w.kafka.Partitions(ctx, fn.Topic)
		switch {
		case errors.Is(err, kafkasource.ErrTopicMissing):
			missing[fn.Name+"\x00"+fn.Topic] = true
			problems = append(problems, fmt.Sprintf("kafka: topic %s of function %s does not exist", fn.Topic, fn.Name))
		case err != nil:
			problems = append(problems, "kafka: "+err.Error())
		default:
			missing[fn.Name+"\x00"+fn.Topic] = false
		}
	}
	if runCtx.Err() != nil {
		return // shutting down: the failures are ours
	}
	w.ready.mu.Lock()
	before, wasChecked, wasMissing := w.ready.problems, w.ready.checked, maps.Clone(w.ready.missing)
	w.ready.problems, w.ready.checked = problems, true
	if w.ready.missing == nil {
		w.ready.missing = map[string]bool{}
	}
	for k, v := range missing { // a topic whose probe failed keeps its last state
		w.ready.missing[k] = v
	}
	w.ready.mu.Unlock()

	for k, now := range missing {
		fn, topic, _ := strings.Cut(k, "\x00")
		switch {
		case now && !wasMissing[k]:
			w.cfg.Logger.Error("topic does not exist: the function waits for it; create it (kfn workers never create topics)",
				"function", fn, "topic", topic)
		case !now && wasMissing[k]:
			w.cfg.Logger.Info("topic exists now", "function", fn, "topic", topic)
		}
	}
	switch {
	case len(problems) > 0 && (!wasChecked || !slices.Equal(problems, before)):
		w.cfg.Logger.Warn("not ready", "problems", problems)
	case len(problems) == 0 && (!wasChecked || len(before) > 0):
		w.cfg.Logger.Info("ready")
	}
}

// serveReadiness answers /readyz: 200 when the last probe found every
// dependency answering, 503 with the problems otherwise.
func (w *worker) serveReadiness(rw http.ResponseWriter, _ *http.Request) {
	problems, checked := w.ready.state()
	rw.Header().Set("Content-Type", "text/plain; charset=utf-8")
	switch {
	case !checked:
		rw.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(rw, "not ready: dependencies not probed yet")
	case len(problems) > 0:
		rw.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(rw, "not ready:")
		for _, p := range problems {
			fmt.Fprintln(rw, "  "+p)
		}
	default:
		fmt.Fprintln(rw, "ready")
	}
}
