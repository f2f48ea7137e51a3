package observe

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestProbeReadyAsksReadyz(t *testing.T) {
	status := http.StatusServiceUnavailable
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/readyz" {
			http.NotFound(w, r)
			return
		}
		w.WriteHeader(status)
	}))
	defer srv.Close()
	_, port, _ := strings.Cut(strings.TrimPrefix(srv.URL, "http://"), ":")
	ctx := context.Background()

	if err := ProbeReady(ctx, ":"+port); err == nil || !strings.Contains(err.Error(), "503") {
		t.Errorf("a 503 from /readyz: got %v, want not ready with the status", err)
	}
	status = http.StatusOK
	for _, addr := range []string{":" + port, "0.0.0.0:" + port, "127.0.0.1:" + port} {
		if err := ProbeReady(ctx, addr); err != nil {
			t.Errorf("ready, --metrics-addr %s: %v", addr, err)
		}
	}
	srv.Close()
	if err := ProbeReady(ctx, ":"+port); err == nil {
		t.Error("nothing listening: got ready")
	}
	if err := ProbeReady(ctx, ""); err == nil || !strings.Contains(err.Error(), "KFN_METRICS_ADDR") {
		t.Errorf("no --metrics-addr: got %v, want an error naming KFN_METRICS_ADDR", err)
	}
}
