package runtime_test

import (
	"bytes"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// lockedBuffer collects a worker's logs while the worker writes them.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// A worker started on a topic that does not exist is visibly not ready: a
// 503 from /readyz that names the topic, kfn_topic_missing 1 and one error
// log line that says what to do. Once the topic is created it turns ready
// by itself and processes what is produced there.
func TestMissingTopicMakesTheWorkerNotReadyUntilItIsCreated(t *testing.T) {
	b := setup(t, 1)
	topic := kfntest.Name(t, "later")
	logs := &lockedBuffer{}
	b.cfg.Logger = slog.New(slog.NewJSONHandler(io.MultiWriter(logs, testWriter{t}), &slog.HandlerOptions{Level: slog.LevelInfo}))
	b.cfg.WorkerID = "ready-worker"
	w, stop := b.run(t, effects.Function(b.fn, topic))
	srv := httptest.NewServer(w.HTTPHandler())
	defer srv.Close()
	get := func(path string) (int, string) { t.Helper(); return httpGet(t, srv.URL+path) }
	missingGauge := `kfn_topic_missing{function="` + b.fn + `",topic="` + topic + `",worker="ready-worker"} `

	waitFor(t, 20*time.Second, "/readyz to report the missing topic", func() bool {
		code, body := get("/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, "kafka: topic "+topic+" of function "+b.fn+" does not exist")
	})
	if _, metrics := get("/metrics"); !strings.Contains(metrics, missingGauge+"1") || !strings.Contains(metrics, `kfn_ready{worker="ready-worker"} 0`) {
		t.Errorf("metrics lack %q and kfn_ready 0:\n%s", missingGauge+"1", grepLines(metrics, "kfn_topic_missing", "kfn_ready"))
	}
	if code, body := get("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz = %d %q; the process is alive, only not ready", code, body)
	}

	b.kafka.CreateTopicNamed(t, topic, 2)
	created := time.Now()
	waitFor(t, 30*time.Second, "/readyz to turn ready once the topic exists", func() bool {
		code, _ := get("/readyz")
		return code == http.StatusOK
	})
	t.Logf("ready %v after the topic was created (probe period 2s)", time.Since(created).Round(time.Millisecond))
	if _, metrics := get("/metrics"); !strings.Contains(metrics, missingGauge+"0") || !strings.Contains(metrics, `kfn_ready{worker="ready-worker"} 1`) {
		t.Errorf("metrics lack %q and kfn_ready 1:\n%s", missingGauge+"0", grepLines(metrics, "kfn_topic_missing", "kfn_ready"))
	}

	b.topic = topic
	produced := b.produceN(t, 2, 10)
	b.waitCaughtUp(t, b.fn)
	stop()
	wantDuplicates(t, w, 0, "waiting for the topic reads nothing twice")
	b.check(t, b.fn, produced)

	out := logs.String()
	if n := strings.Count(out, `"msg":"topic does not exist: the function waits for it; create it (kfn workers never create topics)"`); n != 1 {
		t.Errorf("the missing topic was logged as an error %d times; want once, however long it is missing", n)
	}
	if !strings.Contains(out, `"msg":"topic exists now"`) {
		t.Errorf("the topic's creation was not logged")
	}
}

// grepLines returns the lines of s that contain any of words.
func grepLines(s string, words ...string) string {
	var out []string
	for _, line := range strings.Split(s, "\n") {
		for _, w := range words {
			if strings.Contains(line, w) {
				out = append(out, line)
				break
			}
		}
	}
	return strings.Join(out, "\n")
}
