package kfntest

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/devstack"
)

// EnvNATSURL names a NATS server with JetStream for the tests; see the package doc.
const EnvNATSURL = "KFN_TEST_NATS_URL"

var natsOnce struct {
	sync.Once
	url string
	err error
}

// NATSURL returns the URL of the NATS server shared by the test binary:
// KFN_TEST_NATS_URL if set, else an in-process server with JetStream. Tests
// keep apart by naming their streams, buckets and subjects with Name.
func NATSURL(t testing.TB) string {
	t.Helper()
	if os.Getenv(EnvNATSURL) == "" {
		requireMain(t, "kfntest.NATSURL (in-process NATS server)")
	}
	natsOnce.Do(func() { natsOnce.url, natsOnce.err = startSharedNATS() })
	if natsOnce.err != nil {
		t.Fatalf("kfntest: %v", natsOnce.err)
	}
	return natsOnce.url
}

func startSharedNATS() (string, error) {
	if u := os.Getenv(EnvNATSURL); u != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		version, err := jetStreamReady(ctx, u)
		if err != nil {
			return "", fmt.Errorf("%s=%s: %w", EnvNATSURL, u, err)
		}
		announce("NATS from %s: %s, server version %s", EnvNATSURL, u, version)
		return u, nil
	}
	n, err := devstack.StartNATS("")
	if err != nil {
		return "", fmt.Errorf("start in-process NATS (or set %s): %w", EnvNATSURL, err)
	}
	onShutdown(n.Stop)
	return n.URL, nil
}

// jetStreamReady connects to url and asks JetStream for the account info, so
// it succeeds only once the server accepts clients and JetStream is up. It
// returns the server's version.
func jetStreamReady(ctx context.Context, url string) (string, error) {
	nc, err := nats.Connect(url, nats.Timeout(2*time.Second), nats.NoReconnect())
	if err != nil {
		return "", fmt.Errorf("connect: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return "", fmt.Errorf("jetstream: %w", err)
	}
	if _, err := js.AccountInfo(ctx); err != nil {
		return "", fmt.Errorf("JetStream not available (start nats-server with -js): %w", err)
	}
	return nc.ConnectedServerVersion(), nil
}
