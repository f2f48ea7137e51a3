package connect

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/runtime"
	"github.com/nats-io/nats-server/v2/server"
)

// A client that wants TLS (a CA file) from a real NATS server that offers
// none is CauseTLS, and the message says so.
func TestNATSTLSWantedFromAServerWithoutIt(t *testing.T) {
	natsURL := startServer(t, &server.Options{})
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, []byte(testCA(t)), 0o600); err != nil {
		t.Fatal(err)
	}
	nc, _, err := NATSWith(natsURL, "tls-cause", runtime.NATSSecurity{CAFile: ca})
	if err == nil {
		nc.Close()
		t.Fatal("connected")
	}
	if c := NATSCause(err); c != CauseTLS {
		t.Errorf("cause %v, want tls: %v", c, err)
	}
	if !strings.Contains(err.Error(), "does not offer TLS") {
		t.Errorf("message %q does not say the server offers no TLS", err)
	}
}
