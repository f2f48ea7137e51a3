package monitoring

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/segmentio/kafka-go"
	"sigs.k8s.io/yaml"

	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

const (
	dashboard = "../grafana/kfn.json"
	alerts    = "../kubernetes/base/alerts.yaml"
)

// external are the metrics the alerts or the dashboard query that another
// process exports, each with who does.
var external = map[string]string{
	"keda_scaler_active": "KEDA's operator: whether a ScaledObject's scaler sees lag above its activation threshold; the one series that exists while a function has zero replicas",
}

// TestDashboardAndAlertMetricsAreExported runs a worker and a relay, as
// the Kubernetes base does (a ParkKey function that emits an event per
// record and dead-letters some), scrapes their /metrics, and checks that
// every metric each dashboard panel and each alert rule queries is one
// they export (a histogram's
// _bucket, _sum and _count are its own; recording rules and the metrics
// of external are not kfn's to export).
func TestDashboardAndAlertMetricsAreExported(t *testing.T) {
	exported := scrapeRunningWorker(t)
	queries := dashboardQueries(t, dashboard)
	recorded, alertQueries := ruleQueries(t, alerts)
	if len(queries) < 10 || len(alertQueries) < 10 {
		t.Fatalf("found %d dashboard queries and %d alert expressions; want at least 10 of each", len(queries), len(alertQueries))
	}
	for where, expr := range alertQueries {
		queries[where] = expr
	}
	for where, expr := range queries {
		names, err := queriedMetrics(expr)
		if err != nil {
			t.Errorf("%s: %v", where, err)
			continue
		}
		for _, name := range names {
			if recorded[name] || external[name] != "" || exportedAs(exported, name) {
				continue
			}
			t.Errorf("%s queries %s, which neither a running kfn worker nor kfn relay exports (their kfn_ metrics: %s)", where, name, kfnNames(exported))
		}
	}
}

// exportedAs says whether name is a metric family of the scrape, or a
// histogram's (or summary's) _bucket, _sum or _count series.
func exportedAs(families map[string]dto.MetricType, name string) bool {
	if _, ok := families[name]; ok {
		return true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suffix)
		if !ok {
			continue
		}
		switch typ, ok := families[base]; {
		case !ok:
		case typ == dto.MetricType_HISTOGRAM || typ == dto.MetricType_GAUGE_HISTOGRAM:
			return true
		case typ == dto.MetricType_SUMMARY:
			return suffix != "_bucket"
		}
	}
	return false
}

func kfnNames(families map[string]dto.MetricType) string {
	var names []string
	for n := range families {
		if strings.HasPrefix(n, "kfn_") {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	return strings.Join(names, " ")
}

// grafanaVars are the Grafana variables the dashboard's queries use, with
// values that make them PromQL.
var grafanaVars = strings.NewReplacer("$__rate_interval", "1m", "$__range", "1h", "$__interval", "1m", "$function", ".*")

// queriedMetrics returns the metric names of expr's selectors.
func queriedMetrics(expr string) ([]string, error) {
	e, err := parser.NewParser(parser.Options{}).ParseExpr(grafanaVars.Replace(expr))
	if err != nil {
		return nil, fmt.Errorf("parse %q: %w", expr, err)
	}
	var names []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			if vs.Name == "" {
				err = errors.Join(err, fmt.Errorf("%q: a selector without a metric name", expr))
			}
			names = append(names, vs.Name)
		}
		return nil
	})
	return names, err
}

// dashboardQueries returns every panel's queries (rows' nested panels
// too) and the templating variables' queries, keyed by where they are.
func dashboardQueries(t *testing.T, path string) map[string]string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	type panel struct {
		Title   string `json:"title"`
		Targets []struct {
			RefID string `json:"refId"`
			Expr  string `json:"expr"`
		} `json:"targets"`
		Panels []json.RawMessage `json:"panels"`
	}
	var d struct {
		Panels     []json.RawMessage `json:"panels"`
		Templating struct {
			List []struct {
				Name  string          `json:"name"`
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	out := map[string]string{}
	var walk func([]json.RawMessage)
	walk = func(raw []json.RawMessage) {
		for _, r := range raw {
			var p panel
			if err := json.Unmarshal(r, &p); err != nil {
				t.Fatalf("%s: %v", path, err)
			}
			for _, tg := range p.Targets {
				if tg.Expr == "" {
					t.Errorf("%s: panel %q, query %s: no expr", path, p.Title, tg.RefID)
					continue
				}
				out[fmt.Sprintf("dashboard panel %q query %s", p.Title, tg.RefID)] = tg.Expr
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		if json.Unmarshal(v.Query, &q) != nil {
			json.Unmarshal(v.Query, &q.Query) //nolint:errcheck // a plain string query, or nothing
		}
		// label_values(metric, label): the metric must exist for the
		// variable to list anything.
		if inner, ok := strings.CutPrefix(q.Query, "label_values("); ok {
			metric, _, _ := strings.Cut(inner, ",")
			out[fmt.Sprintf("dashboard variable %s", v.Name)] = strings.TrimSpace(metric)
		}
	}
	return out
}

// ruleQueries returns the alert rules' expressions (keyed by alert) and the
// names the file's recording rules define.
func ruleQueries(t *testing.T, path string) (recorded map[string]bool, exprs map[string]string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var rule struct {
		Spec struct {
			Groups []struct {
				Rules []struct {
					Alert  string `json:"alert"`
					Record string `json:"record"`
					Expr   string `json:"expr"`
				} `json:"rules"`
			} `json:"groups"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(data, &rule); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	recorded, exprs = map[string]bool{}, map[string]string{}
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			if r.Record != "" {
				recorded[r.Record] = true
				exprs["recording rule "+r.Record] = r.Expr
				continue
			}
			exprs["alert "+r.Alert] = r.Expr
		}
	}
	return recorded, exprs
}

// scrapeRunningWorker runs what the Kubernetes base runs: a worker with
// --no-relay (one ParkKey function over a few records, some dead-lettered,
// each applied one emitting an event) and `kfn relay` beside it (the
// engine's Relay, which kfn relay runs), until the relay has published the
// events and the worker's offset mirror has flushed, and returns the
// metric families of both /metrics pages and their types.
func scrapeRunningWorker(t *testing.T) map[string]dto.MetricType {
	t.Helper()
	ctx := context.Background()
	pg, kc := kfntest.Postgres(t), kfntest.Kafka(t)
	// The WAL outbox set up, so that its slot's gauges are exported too
	// (the relay reads the slot while it is set up, whatever the mode).
	if _, err := outbox.SetUpWAL(ctx, pg.Pool); err != nil {
		t.Fatalf("set up the WAL outbox: %v", err)
	}
	topic := kc.CreateTopic(t, 2)
	name := kfntest.Name(t, "fn")
	subject := name + ".done"
	cfg := runtime.Config{
		KafkaBrokers: kc.Brokers, DatabaseURL: pg.URL, NATSURL: kfntest.NATSURL(t),
		LeaseBucket: kfntest.Name(t, "leases"), BatchSize: 100, BatchWait: 5 * time.Millisecond,
		RetryAttempts: 1, RetryInitial: time.Millisecond, RetryMax: time.Millisecond,
		WorkerID: "monitoring-" + name, NoRelay: true,
	}
	fn := runtime.Function{
		Name: name, Topic: topic, Emits: []string{subject}, KeyOrder: runtime.ParkKey,
		Handler: func(_ context.Context, _ pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			if string(rec.Value) == "bad" {
				return runtime.Permanent(errors.New("a bad record"))
			}
			out.Emit(runtime.Event{Subject: subject, Data: rec.Value})
			return nil
		},
	}
	var msgs []kafka.Message
	for i := range 20 {
		v := "ok"
		if i%7 == 3 {
			v = "bad"
		}
		msgs = append(msgs, kafka.Message{Partition: i % 2, Key: fmt.Appendf(nil, "k%d", i%5), Value: []byte(v)})
	}
	kc.Produce(t, topic, msgs...)
	w, err := worker.New(ctx, cfg, fn)
	if err != nil {
		t.Fatal(err)
	}
	defer kfntest.Background(t, "worker", w.Run)()
	relayCfg := cfg
	relayCfg.WorkerID = "monitoring-relay-" + name
	relay, err := engine.NewRelay(ctx, relayCfg, []string{subject})
	if err != nil {
		t.Fatal(err)
	}
	defer kfntest.Background(t, "relay", relay.Run)()
	workerSrv, relaySrv := httptest.NewServer(w.HTTPHandler()), httptest.NewServer(relay.HTTPHandler())
	defer workerSrv.Close()
	defer relaySrv.Close()

	// Done when every record is applied or dead-lettered, the relay has
	// published, and the offset mirror has flushed once (its first flush
	// checks the consumer group, which kfn_consumer_group_refused reports).
	var families map[string]dto.MetricType
	kfntest.Await(t, 60*time.Second, "the worker to apply or dead-letter every record, the relay to publish and the worker's offset mirror to flush", func() (bool, string) {
		families = scrape(t, workerSrv.URL+"/metrics")
		for name, typ := range scrape(t, relaySrv.URL+"/metrics") {
			families[name] = typ
		}
		s := w.Stats()
		done := s.Applied.Load() + s.DeadLettered.Load()
		published := relay.Stats().Published
		_, mirrored := families["kfn_consumer_group_refused"]
		return done == int64(len(msgs)) && published > 0 && mirrored,
			fmt.Sprintf("%d of %d records done, %d events published, consumer group checked: %v", done, len(msgs), published, mirrored)
	})
	return families
}

// scrape returns the metric families of a /metrics page and their types.
func scrape(t *testing.T, url string) map[string]dto.MetricType {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	tp := expfmt.NewTextParser(model.UTF8Validation)
	parsed, err := tp.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	out := map[string]dto.MetricType{}
	for name, mf := range parsed {
		out[name] = mf.GetType()
	}
	return out
}
