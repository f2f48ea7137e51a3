package runtime_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// scrape is a parsed Prometheus text exposition: one sample per line.
type scrape []sample

type sample struct {
	name   string
	labels map[string]string
	value  float64
}

func scrapeMetrics(t *testing.T, url string) scrape {
	t.Helper()
	_, body := httpGet(t, url)
	return parseExposition(t, body)
}

// httpGet returns the status and body of a GET of url.
func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(data)
}

// parseExposition reads the text format as client_golang writes it: label
// values hold no '}' or '",' in these tests.
func parseExposition(t *testing.T, text string) scrape {
	t.Helper()
	var out scrape
	for _, line := range strings.Split(text, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		sp := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[sp+1:], 64)
		if err != nil {
			t.Fatalf("metrics line %q: %v", line, err)
		}
		s := sample{labels: map[string]string{}, value: v}
		head := line[:sp]
		if i := strings.IndexByte(head, '{'); i >= 0 {
			s.name = head[:i]
			for _, kv := range strings.Split(strings.TrimSuffix(head[i+1:], "}"), `",`) {
				k, val, _ := strings.Cut(kv, `="`)
				s.labels[k] = strings.TrimSuffix(val, `"`)
			}
		} else {
			s.name = head
		}
		out = append(out, s)
	}
	return out
}

// get returns the value of the one sample named name with the labels given
// as "k", "v" pairs (others may differ), and whether there is one.
func (sc scrape) get(name string, kv ...string) (float64, bool) {
	found, v := 0, 0.0
next:
	for _, s := range sc {
		if s.name != name {
			continue
		}
		for i := 0; i+1 < len(kv); i += 2 {
			if s.labels[kv[i]] != kv[i+1] {
				continue next
			}
		}
		found++
		v = s.value
	}
	return v, found == 1
}

func (sc scrape) has(name string) bool {
	for _, s := range sc {
		if s.name == name {
			return true
		}
	}
	return false
}

// TestMetricsAgreeWithTheDatabase runs a worker with two functions (one
// record at a time, and batches) over records of which some are
// dead-lettered for known reasons, and checks that the scraped counters
// agree with the database per function and reason, that every histogram has
// samples, and that the outbox, lease and stall gauges are there.
func TestMetricsAgreeWithTheDatabase(t *testing.T) {
	b := setup(t, 2)
	b.cfg.WorkerID = "metrics-db"
	ctx := context.Background()
	produced := b.produceN(t, 2, 20)
	b.produce(t, 0, []byte(effects.Permanent), []byte(effects.Panic), []byte(effects.Permanent), []byte(effects.Always))
	b.produce(t, 1, []byte(effects.Permanent), []byte("{not json"))
	produced = append(produced, b.produceN(t, 2, 5)...)
	single, batch := b.fn, b.fn+"_b"
	w, err := worker.New(ctx, b.cfg, effects.Function(single, b.topic), effects.BatchFunction(batch, b.topic))
	if err != nil {
		t.Fatal(err)
	}
	stop := kfntest.Background(t, "worker", w.Run)
	defer stop()
	b.waitCaughtUp(t, single)
	b.waitCaughtUp(t, batch)
	srv := httptest.NewServer(w.HTTPHandler())
	defer srv.Close()

	// The counters settle in the scrape itself: a commit adds to the
	// worker's total a moment before its function's count, so a scrape
	// taken before the total was checked could miss the last batch.
	var sc scrape
	waitFor(t, 30*time.Second, "the relay to publish and the counters to settle", func() bool {
		sc = scrapeMetrics(t, srv.URL+"/metrics")
		n, _ := sc.get("kfn_outbox_published_total")
		a, _ := sc.get("kfn_records_applied_total", "function", single)
		b, _ := sc.get("kfn_records_applied_total", "function", batch)
		return a == float64(len(produced)) && b == float64(len(produced)) && n >= float64(2*len(produced))
	})
	if got := w.Stats().Applied.Load(); got != int64(2*len(produced)) {
		t.Errorf("the worker's Stats().Applied = %d; want %d, the sum of its functions'", got, 2*len(produced))
	}
	for _, fn := range []string{single, batch} {
		var applied int
		if err := b.pg.Pool.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %s`, pgx.Identifier{"effects_" + fn}.Sanitize())).Scan(&applied); err != nil {
			t.Fatal(err)
		}
		if v, ok := sc.get("kfn_records_applied_total", "function", fn); !ok || v != float64(applied) {
			t.Errorf("kfn_records_applied_total{function=%s} = %v (present %v); the database has %d effects", fn, v, ok, applied)
		}
		dead := map[string]int{}
		rows, err := b.pg.Pool.Query(ctx, `SELECT reason, count(*) FROM kfn.dead_letters WHERE consumer = $1 GROUP BY reason`, fn)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var reason string
			var n int
			if err := rows.Scan(&reason, &n); err != nil {
				t.Fatal(err)
			}
			dead[reason] = n
		}
		if rows.Err() != nil {
			t.Fatal(rows.Err())
		}
		if dead["permanent"] != 4 || dead["panic"] != 1 || dead["handler_error"] != 1 {
			t.Errorf("function %s: dead letters per reason %v; want permanent 4 (three commands and a malformed JSON), panic 1, handler_error 1", fn, dead)
		}
		for _, reason := range []string{"panic", "timeout", "data_error", "permanent", "handler_error", "oversized"} {
			if v, ok := sc.get("kfn_records_dead_lettered_total", "function", fn, "reason", reason); !ok || v != float64(dead[reason]) {
				t.Errorf("kfn_records_dead_lettered_total{function=%s,reason=%s} = %v (present %v); the database has %d", fn, reason, v, ok, dead[reason])
			}
		}
		if v, ok := sc.get("kfn_leases_held", "function", fn); !ok || v != 2 {
			t.Errorf("kfn_leases_held{function=%s} = %v (present %v), want 2", fn, v, ok)
		}
		if v, ok := sc.get("kfn_lanes_stalled", "function", fn); !ok || v != 0 {
			t.Errorf("kfn_lanes_stalled{function=%s} = %v (present %v), want 0", fn, v, ok)
		}
		for _, h := range []string{"kfn_batch_records", "kfn_batch_duration_seconds", "kfn_handler_duration_seconds", "kfn_record_age_at_commit_seconds"} {
			count, okc := sc.get(h+"_count", "function", fn)
			sum, oks := sc.get(h+"_sum", "function", fn)
			if !okc || !oks || count <= 0 || sum <= 0 {
				t.Errorf("%s{function=%s}: count %v sum %v (present %v %v); want samples", h, fn, count, sum, okc, oks)
			}
		}
	}
	if count, ok := sc.get("kfn_outbox_ack_latency_seconds_count"); !ok || count < float64(2*len(produced)) {
		t.Errorf("kfn_outbox_ack_latency_seconds_count = %v (present %v), want at least %d", count, ok, 2*len(produced))
	}
	for _, g := range []string{"kfn_outbox_backlog", "kfn_outbox_oldest_age_seconds"} {
		if _, ok := sc.get(g); !ok {
			t.Errorf("metrics lack %s", g)
		}
	}
	requireMetricsDocumented(t, sc)
}

// requireMetricsDocumented checks that the metrics table of
// docs/observability.md has a row for every kfn metric a running worker
// exposes.
func requireMetricsDocumented(t *testing.T, sc scrape) {
	t.Helper()
	const page = "../docs/observability.md"
	doc, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, s := range sc {
		if !strings.HasPrefix(s.name, "kfn_") {
			continue
		}
		name := s.name
		if _, isHistogram := s.labels["le"]; isHistogram || strings.HasSuffix(name, "_sum") || strings.HasSuffix(name, "_count") {
			name = strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_sum"), "_count")
		}
		if seen[name] {
			continue
		}
		seen[name] = true
		if !strings.Contains(string(doc), "| `"+name+"` |") {
			t.Errorf("the metrics table of %s has no row for %s", page, name)
		}
	}
}

// TestMetricsDuringKafkaOutage stops the worker's Kafka broker for 8 s: the
// lanes keep their partitions (issue 8), so kfn_partition_lag keeps every
// partition's series with its last value; the worker is not ready
// (kfn_ready 0, /readyz 503 naming Kafka) within two probe periods, but
// alive (/healthz 200), and ready again once the broker is back.
func TestMetricsDuringKafkaOutage(t *testing.T) {
	pk := kfntest.NewPrivateKafka(t)
	b := &bundle{pg: kfntest.Postgres(t), kafka: pk.KafkaCluster}
	b.topic = b.kafka.CreateTopic(t, 2)
	b.fn = kfntest.Name(t, "fn")
	b.cfg = runtime.Config{
		KafkaBrokers: b.kafka.Brokers, DatabaseURL: b.pg.URL, NATSURL: kfntest.NATSURL(t),
		LeaseBucket: kfntest.Name(t, "leases"), BatchSize: 100, BatchWait: 5 * time.Millisecond,
		WorkerID: "metrics-outage", Logger: testLogger(t),
	}
	b.produceN(t, 2, 10)
	w, stop := b.run(t, effects.Function(b.fn, b.topic))
	defer stop()
	b.waitCaughtUp(t, b.fn)
	srv := httptest.NewServer(w.HTTPHandler())
	defer srv.Close()
	lag := func(sc scrape) map[string]float64 {
		out := map[string]float64{}
		for _, s := range sc {
			if s.name == "kfn_partition_lag" && s.labels["function"] == b.fn {
				out[s.labels["partition"]] = s.value
			}
		}
		return out
	}
	// The cursor in Postgres moves before the worker's own counters do (the
	// commit lands, then its reply arrives): wait until the worker shows
	// both partitions caught up too.
	var before map[string]float64
	waitFor(t, 10*time.Second, "the lag of both partitions to settle at 0", func() bool {
		before = lag(scrapeMetrics(t, srv.URL+"/metrics"))
		return len(before) == 2 && before["0"] == 0 && before["1"] == 0
	})

	ready := func() float64 {
		v, ok := scrapeMetrics(t, srv.URL+"/metrics").get("kfn_ready")
		if !ok {
			t.Fatal("no kfn_ready series")
		}
		return v
	}
	waitFor(t, 10*time.Second, "the worker to be ready before the outage", func() bool { return ready() == 1 })

	pk.Stop()
	stopped := time.Now()
	// The probe runs every 2 s and may take 2 s: two periods and a margin.
	waitFor(t, 5*time.Second, "kfn_ready to drop to 0 in the outage", func() bool { return ready() == 0 })
	notReady := time.Since(stopped)
	if code, body := httpGet(t, srv.URL+"/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "kafka: brokers") {
		t.Errorf("/readyz in the Kafka outage = %d %q, want 503 naming Kafka", code, body)
	}
	if code, body := httpGet(t, srv.URL+"/healthz"); code != http.StatusOK {
		t.Errorf("/healthz in the Kafka outage = %d %q, want 200: an outage of another service must not restart the worker", code, body)
	}
	time.Sleep(8*time.Second - time.Since(stopped)) // the readers fail and the lanes wait for the broker
	sc := scrapeMetrics(t, srv.URL+"/metrics")
	if v, _ := sc.get("kfn_ready"); v != 0 {
		t.Errorf("kfn_ready 8 s into the Kafka outage = %v, want 0", v)
	}
	during := lag(sc)
	if len(during) != 2 || during["0"] != before["0"] || during["1"] != before["1"] {
		t.Errorf("kfn_partition_lag during the outage %v; before it %v: want the same series and values", during, before)
	}
	if v, ok := sc.get("kfn_leases_held", "function", b.fn); !ok || v != 2 {
		t.Errorf("kfn_leases_held during the outage = %v (present %v), want 2", v, ok)
	}
	if err := pk.Start(); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	waitFor(t, 15*time.Second, "kfn_ready to return to 1 after the outage", func() bool { return ready() == 1 })
	t.Logf("Kafka outage of %s: kfn_ready 0 after %s, 1 again %s after the broker returned (probe period 2s)",
		back.Sub(stopped).Round(time.Millisecond), notReady.Round(time.Millisecond), time.Since(back).Round(time.Millisecond))
}

// TestMetricsCountAStalledLane holds a partition on a record that keeps
// failing (long retries): the lane has lag and no commit, so after
// --stall-after it counts in kfn_lanes_stalled.
func TestMetricsCountAStalledLane(t *testing.T) {
	b := setup(t, 1)
	b.cfg.WorkerID = "metrics-stall"
	b.cfg.StallAfter = time.Second
	b.cfg.RetryAttempts, b.cfg.RetryInitial, b.cfg.RetryMax = 1000, 200*time.Millisecond, 200*time.Millisecond
	b.produce(t, 0, []byte(effects.Always), []byte("a"), []byte("b"))
	w, stop := b.run(t, effects.Function(b.fn, b.topic))
	defer stop()
	srv := httptest.NewServer(w.HTTPHandler())
	defer srv.Close()
	var sc scrape
	waitFor(t, 20*time.Second, "the lane to count as stalled", func() bool {
		sc = scrapeMetrics(t, srv.URL+"/metrics")
		v, _ := sc.get("kfn_lanes_stalled", "function", b.fn)
		return v == 1
	})
	if lag, ok := sc.get("kfn_partition_lag", "function", b.fn, "partition", "0"); !ok || lag != 3 {
		t.Errorf("kfn_partition_lag = %v (present %v), want 3", lag, ok)
	}
	if r, ok := sc.get("kfn_handler_retries_total", "function", b.fn); !ok || r < 1 {
		t.Errorf("kfn_handler_retries_total = %v (present %v), want retries", r, ok)
	}
}

// TestAuthorMetricsAreServed gives a function a counter of its own
// (Function.Metrics), which its handler counts, and scrapes it from the
// worker's /metrics beside kfn's, with the worker label; a second
// collector of the same name fails NewWorker, naming the function.
func TestAuthorMetricsAreServed(t *testing.T) {
	b := setup(t, 1)
	b.cfg.WorkerID = "author-metrics"
	seen := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "orders_seen_total", Help: "Orders the handler saw."}, []string{"kind"})
	fn := runtime.Function{
		Name: b.fn, Topic: b.topic, Metrics: []prometheus.Collector{seen},
		Handler: func(context.Context, pgx.Tx, runtime.Record, *runtime.Events) error {
			seen.WithLabelValues("order").Inc()
			return nil
		},
	}
	b.produceN(t, 1, 5)
	w, stop := b.run(t, fn)
	defer stop()
	srv := httptest.NewServer(w.HTTPHandler())
	defer srv.Close()
	// The handler counts a record before its transaction commits, and the
	// worker after: one scrape must show both at 5.
	waitFor(t, 20*time.Second, "one scrape with the author's counter and kfn_records_applied_total both at 5", func() bool {
		sc := scrapeMetrics(t, srv.URL+"/metrics")
		seen, _ := sc.get("orders_seen_total", "kind", "order", "worker", "author-metrics")
		applied, _ := sc.get("kfn_records_applied_total", "function", b.fn)
		return seen == 5 && applied == 5
	})

	clash := prometheus.NewCounter(prometheus.CounterOpts{Name: "orders_seen_total", Help: "Another."})
	fn.Metrics = append(fn.Metrics, clash)
	if _, err := worker.New(context.Background(), b.cfg, fn); err == nil || !strings.Contains(err.Error(), "function "+b.fn+": Metrics") {
		t.Errorf("NewWorker with two collectors named orders_seen_total: %v; want an error naming the function's Metrics", err)
	}
}
