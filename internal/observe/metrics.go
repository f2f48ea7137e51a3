package observe

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kfn-dev/kfn/outbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// Sources are what a worker's metrics are read from, at each scrape.
type Sources struct {
	WorkerID   string         // the worker label of every series
	Functions  []kfn.Function // the worker's functions: their series exist from the start
	StallAfter time.Duration  // --stall-after (0: the default)
	Stats      *Stats
	// Pool is sampled for the outbox backlog; nil: no outbox gauges.
	Pool *pgxpool.Pool
	// Ready is the last probe of the services (what /readyz says) and
	// whether one has run; TopicMissing, by function and topic, whether a
	// consumed topic is missing.
	Ready        func() (problems []string, checked bool)
	TopicMissing func() map[[2]string]bool
	// Mirror is the Kafka consumer-group mirror's state; nil without Kafka.
	Mirror func() (refused map[string]bool, failures int64)
	// Relay is the worker's outbox relay's counters, and false when it runs
	// none.
	Relay func() (outbox.RelayStats, bool)
}

// metricsCollector exposes a worker's Stats (and its relay's) to Prometheus.
// It reads the live counters at scrape time, so nothing is counted twice.
type metricsCollector struct {
	src Sources

	applied, duplicates, deadLettered, retries, batches, fenced *prometheus.Desc
	lag, cursor, epoch                                          *prometheus.Desc
	ready, topicMissing                                         *prometheus.Desc
	relayed, relayDuplicates, relayFailures, relayLatency       *prometheus.Desc
	infraRetries, traceDropped                                  *prometheus.Desc
	abandoned, abandonedRunning, commitRepliesLost              *prometheus.Desc
	deadLetterRetries, parkedKeys, keyParked                    *prometheus.Desc
	groupRefused, mirrorFailures                                *prometheus.Desc
	fenceTerminateDenied                                        *prometheus.Desc

	// issue 12: outbox, stalled lanes, leases, relay ack latency (metrics_ops.go)
	ops *opsMetrics
}

func newMetricsCollector(src Sources) *metricsCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("kfn_"+name, help, labels, prometheus.Labels{"worker": src.WorkerID})
	}
	part := []string{"function", "source", "partition"}
	return &metricsCollector{
		src:                  src,
		applied:              d("records_applied_total", "Records whose handler transaction committed.", "function"),
		duplicates:           d("records_duplicate_total", "Records skipped because they were handled before.", "function"),
		deadLettered:         d("records_dead_lettered_total", "Records parked in kfn.dead_letters, per reason (panic, timeout, data_error, permanent, handler_error, oversized).", "function", "reason"),
		retries:              d("handler_retries_total", "Handler retries.", "function"),
		batches:              d("batches_committed_total", "Committed batch transactions.", "function"),
		fenced:               d("lanes_fenced_total", "Partitions or subjects dropped because a newer owner claimed them.", "function"),
		lag:                  d("partition_lag", "Records behind the cursor, per owned partition.", part...),
		cursor:               d("partition_cursor", "Next offset to apply, per owned partition.", part...),
		epoch:                d("partition_epoch", "Fencing token the partition is owned with.", part...),
		ready:                d("ready", "1 when Postgres (with a compatible schema), NATS JetStream and Kafka answer and every consumed topic exists, as /readyz says."),
		topicMissing:         d("topic_missing", "1 while a consumed topic does not exist: the function waits for it.", "function", "topic"),
		relayed:              d("outbox_published_total", "Outbox events the stream acked as new."),
		relayDuplicates:      d("outbox_duplicates_total", "Outbox events the stream reported as duplicates."),
		relayFailures:        d("outbox_publish_failures_total", "Failed outbox publishes (retried)."),
		relayLatency:         d("outbox_last_latency_seconds", "Commit-to-ack latency of the last relayed event."),
		infraRetries:         d("batch_infra_retries_total", "Batches retried after an infrastructure error (never a record's fault).", "function"),
		traceDropped:         d("trace_context_dropped_total", "Records whose invalid W3C traceparent, tracestate or baggage was ignored.", "function"),
		abandoned:            d("handlers_abandoned_total", "Handler calls that overran --handler-timeout without returning: their session was ended and the record dead-lettered (reason timeout).", "function"),
		abandonedRunning:     d("handlers_abandoned_running", "Abandoned handler calls still running (Go cannot stop them).", "function"),
		commitRepliesLost:    d("commit_replies_lost_total", "Commits that landed although their reply was lost; the lane resumed from the stored cursor.", "function"),
		deadLetterRetries:    d("dead_letter_retries_total", "Dead letters marked for retry (kfn dlq retry) that this worker applied (outcome applied) or whose retry failed again (outcome failed: the letter stays).", "function", "outcome"),
		groupRefused:         d("consumer_group_refused", "1 while the Kafka consumer group offsets are mirrored to (--consumer-group) is another consumer's (members, or offsets kfn did not write): nothing is mirrored there.", "group"),
		mirrorFailures:       d("offset_mirror_failures_total", "Failed commits of offsets to the Kafka consumer group (best effort, retried at the next flush)."),
		ops:                  newOpsMetrics(src),
		parkedKeys:           d("parked_keys", "Keys whose records are held back in this worker's partitions (KeyOrder ParkKey): parked behind a dead letter until it is retried or discarded, or released with parked records still to retry.", "function"),
		fenceTerminateDenied: d("fence_terminate_denied_total", "Lane claims refused because a frozen older owner's session held the cursor row and this worker's role may not end it (no pg_signal_backend, another role): the claim waits for the older transaction to end.", "function"),
		keyParked:            d("records_key_parked_total", "Records dead-lettered with reason key_parked: parked behind an earlier dead letter of their key (KeyOrder ParkKey). Also in kfn_records_dead_lettered_total.", "function"),
	}
}

// Describe describes nothing: the collector is unchecked, so registering it
// does not Collect (which would sample the outbox at registration and serve
// that sample to the first scrapes).
func (c *metricsCollector) Describe(chan<- *prometheus.Desc) {}

func (c *metricsCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.src.Stats
	counter := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v)
	}
	// Per-function counters (issue 12): every function of the worker has
	// its series from the start, every dead-letter reason too.
	fns := s.Functions()
	for _, fn := range c.src.Functions {
		if _, ok := fns[fn.Name]; !ok {
			fns[fn.Name] = FunctionCounters{}
		}
	}
	for name, f := range fns {
		fc := func(d *prometheus.Desc, v int64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), name)
		}
		fc(c.applied, f.Applied)
		fc(c.duplicates, f.Duplicates)
		fc(c.retries, f.Retries)
		fc(c.batches, f.Batches)
		fc(c.fenced, f.Fenced)
		fc(c.infraRetries, f.InfraRetries)
		fc(c.traceDropped, f.TraceContextDropped)
		fc(c.abandoned, f.AbandonedHandlers)
		fc(c.commitRepliesLost, f.CommitRepliesLost)
		fc(c.keyParked, f.KeyParked)
		fc(c.fenceTerminateDenied, f.FenceTerminateDenied)
		ch <- prometheus.MustNewConstMetric(c.abandonedRunning, prometheus.GaugeValue, float64(f.AbandonedHandlersRunning), name)
		ch <- prometheus.MustNewConstMetric(c.deadLetterRetries, prometheus.CounterValue, float64(f.DeadLetterRetriesApplied), name, "applied")
		ch <- prometheus.MustNewConstMetric(c.deadLetterRetries, prometheus.CounterValue, float64(f.DeadLetterRetriesFailed), name, "failed")
		for _, reason := range deadLetterReasons {
			ch <- prometheus.MustNewConstMetric(c.deadLettered, prometheus.CounterValue, float64(f.DeadLettered[reason]), name, reason)
		}
		for reason, n := range f.DeadLettered {
			if !slices.Contains(deadLetterReasons, reason) {
				ch <- prometheus.MustNewConstMetric(c.deadLettered, prometheus.CounterValue, float64(n), name, reason)
			}
		}
	}
	c.ops.collect(ch, s, fns)
	parked := map[string]int{}
	for _, p := range s.Partitions() {
		labels := []string{p.Function, p.Topic, strconv.Itoa(int(p.Partition))}
		ch <- prometheus.MustNewConstMetric(c.lag, prometheus.GaugeValue, float64(p.Lag()), labels...)
		ch <- prometheus.MustNewConstMetric(c.cursor, prometheus.GaugeValue, float64(p.NextOffset), labels...)
		ch <- prometheus.MustNewConstMetric(c.epoch, prometheus.GaugeValue, float64(p.Epoch), labels...)
		parked[p.Function] += p.ParkedKeys
	}
	for _, fn := range c.src.Functions {
		if fn.KeyOrder == kfn.ParkKey {
			ch <- prometheus.MustNewConstMetric(c.parkedKeys, prometheus.GaugeValue, float64(parked[fn.Name]), fn.Name)
		}
	}
	problems, checked := c.src.Ready()
	ready := 0.0
	if checked && len(problems) == 0 {
		ready = 1
	}
	ch <- prometheus.MustNewConstMetric(c.ready, prometheus.GaugeValue, ready)
	for ft, missing := range c.src.TopicMissing() {
		v := 0.0
		if missing {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(c.topicMissing, prometheus.GaugeValue, v, ft[0], ft[1])
	}
	if c.src.Mirror != nil {
		refused, failures := c.src.Mirror()
		counter(c.mirrorFailures, float64(failures))
		for group, no := range refused {
			v := 0.0
			if no {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(c.groupRefused, prometheus.GaugeValue, v, group)
		}
	}
	if r, ok := c.src.Relay(); ok {
		counter(c.relayed, float64(r.Published))
		counter(c.relayDuplicates, float64(r.Duplicates))
		counter(c.relayFailures, float64(r.Failures))
		ch <- prometheus.MustNewConstMetric(c.relayLatency, prometheus.GaugeValue, r.LastLatency.Seconds())
		c.ops.collectRelay(ch, r)
	}
}

// Handler serves reg's metrics at /metrics, a liveness check at /healthz
// (the process serves HTTP) and readyz at /readyz.
func Handler(reg *prometheus.Registry, readyz http.HandlerFunc) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/readyz", readyz)
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Write([]byte("ok\n")) //nolint:errcheck // the client went away
	})
	return mux
}

// Registry gathers what /metrics serves: kfn's own collectors, the Go and
// process collectors, and the collectors of every function's Metrics (the
// author's own). kfn's histograms and the authors' collectors get the
// worker label, as kfn's other series have. A function's collector that
// cannot be registered (a name or labels clashing with another's) is an
// error naming the function; the registry then serves the rest.
func Registry(src Sources) (*prometheus.Registry, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(newMetricsCollector(src), prometheus.NewGoCollector(), prometheus.NewProcessCollector(prometheus.ProcessCollectorOpts{}))
	labelled := prometheus.WrapRegistererWith(prometheus.Labels{"worker": src.WorkerID}, reg)
	// issue 12: the per-function histograms.
	labelled.MustRegister(src.Stats.hist().collectors()...)
	var errs []error
	for _, fn := range src.Functions {
		for _, c := range fn.Metrics {
			err := labelled.Register(c)
			if are := (prometheus.AlreadyRegisteredError{}); errors.As(err, &are) {
				continue // one collector given to two functions of the worker
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("function %s: Metrics: %w", fn.Name, err))
			}
		}
	}
	return reg, errors.Join(errs...)
}
