package observe

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/kfn-dev/kfn/internal/settings"
)

// HealthcheckUsage is the -h line of --healthcheck, a flag of the function
// binaries and of kfn relay.
const HealthcheckUsage = "ask the process serving --metrics-addr on this host whether it is ready (/readyz), exit 0 if so and 1 if not, and exit: a health check for images without a shell"

// ProbeReady asks the process serving /readyz on metricsAddr (":9464": an
// address without a host means this host) whether it is ready. It is the
// command of a container health check in an image that has no shell, curl
// or wget (FROM scratch, distroless).
func ProbeReady(ctx context.Context, metricsAddr string) error {
	if metricsAddr == "" {
		return fmt.Errorf("--%s (%s) is not set: no /readyz to probe; set it as the process being checked has it, e.g. :9464",
			settings.MetricsAddr.Flag, settings.MetricsAddr.Env)
	}
	host, port, err := net.SplitHostPort(metricsAddr)
	if err != nil {
		return fmt.Errorf("--%s (%s) %q: %v", settings.MetricsAddr.Flag, settings.MetricsAddr.Env, metricsAddr, err)
	}
	if host == "" || net.ParseIP(host).IsUnspecified() {
		host = "127.0.0.1"
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	url := "http://" + net.JoinHostPort(host, port) + "/readyz"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("not ready: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("not ready: %s answered %s", url, resp.Status)
	}
	return nil
}
