package kfntest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/devstack"
)

// natsServerPkg is built with `go build`; it is in kfn's module graph, so the
// binary matches the embedded server's version.
const natsServerPkg = "github.com/nats-io/nats-server/v2"

// natsStartTimeout bounds how long Start waits for the port and JetStream.
const natsStartTimeout = 20 * time.Second

// NATSServer is a real nats-server running as its own process, for fault
// tests that kill or restart NATS. Its JetStream store survives Stop/Start
// and Kill/Start, and it keeps its port, so clients can reconnect.
type NATSServer struct {
	// URL is nats://127.0.0.1:PORT.
	URL string
	// StoreDir is the JetStream store directory.
	StoreDir string

	// Name is the server's name (-n): "kfntest", or "kfntest-N" in a
	// cluster, as JetStream's cluster info reports leaders.
	Name string

	t    testing.TB
	bin  string
	port int
	args []string // more arguments: the cluster's
	mu   sync.Mutex
	proc *Process
}

// NATSProcess builds nats-server once per test binary, starts it with
// JetStream on a free port and a fresh store dir, and stops it when the test
// ends.
func NATSProcess(t testing.TB) *NATSServer {
	t.Helper()
	s := newNATSServer(t, "kfntest")
	if err := s.Start(); err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	return s
}

func newNATSServer(t testing.TB, name string) *NATSServer {
	t.Helper()
	port, err := devstack.FreePort()
	if err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	return &NATSServer{
		URL:      "nats://127.0.0.1:" + strconv.Itoa(port),
		StoreDir: t.TempDir(),
		Name:     name,
		t:        t,
		bin:      BuildBinary(t, natsServerPkg),
		port:     port,
	}
}

// NATSClusterProcesses starts n nats-server processes (n ≥ 3 for a
// JetStream quorum that survives one loss) routed into one cluster with
// clustered JetStream, and waits until each one's JetStream answers. Each
// can be killed and started again like a NATSProcess; JoinURLs gives the
// URL list clients take.
func NATSClusterProcesses(t testing.TB, n int) []*NATSServer {
	t.Helper()
	servers := make([]*NATSServer, n)
	routes := make([]string, n)
	clusterPorts := make([]int, n)
	for i := range servers {
		servers[i] = newNATSServer(t, "kfntest-"+strconv.Itoa(i+1))
		port, err := devstack.FreePort()
		if err != nil {
			t.Fatalf("kfntest: %v", err)
		}
		clusterPorts[i] = port
		routes[i] = "nats://127.0.0.1:" + strconv.Itoa(port)
	}
	for i, s := range servers {
		s.args = []string{"--cluster_name", "kfntest", "--cluster", routes[i], "--routes", strings.Join(routes, ",")}
		// A JetStream quorum needs the others: launch all, then wait.
		if err := s.launch(); err != nil {
			t.Fatalf("kfntest: %v", err)
		}
	}
	for _, s := range servers {
		if err := s.ready(); err != nil {
			t.Fatalf("kfntest: %v", err)
		}
	}
	return servers
}

// JoinURLs is the comma-separated URL list of servers, as --nats-url takes it.
func JoinURLs(servers []*NATSServer) string {
	urls := make([]string, len(servers))
	for i, s := range servers {
		urls[i] = s.URL
	}
	return strings.Join(urls, ",")
}

// Start starts the server (again) on the same port with the same store and
// waits until it accepts clients and JetStream answers.
func (s *NATSServer) Start() error {
	if err := s.launch(); err != nil {
		return err
	}
	return s.ready()
}

// launch starts the server process (again) without waiting for it.
func (s *NATSServer) launch() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil {
		select {
		case <-s.proc.Exited():
		default:
			return fmt.Errorf("nats-server on %s is already running", s.URL)
		}
	}
	args := append([]string{"-js", "-sd", s.StoreDir, "-a", "127.0.0.1", "-p", strconv.Itoa(s.port), "-n", s.Name}, s.args...)
	proc, err := startProcess(s.t, exec.Command(s.bin, args...))
	if err != nil {
		return fmt.Errorf("start nats-server: %w", err)
	}
	s.proc = proc
	return nil
}

// ready waits until the launched server accepts clients and JetStream
// answers, and kills it if it does not within natsStartTimeout.
func (s *NATSServer) ready() error {
	proc := s.current()
	ctx, cancel := context.WithTimeout(context.Background(), natsStartTimeout)
	defer cancel()
	if err := s.waitReady(ctx); err != nil {
		proc.Kill()
		return fmt.Errorf("nats-server on %s did not become ready: %w\noutput (tail):\n%s", s.URL, err, proc.LogTail(30))
	}
	return nil
}

func (s *NATSServer) waitReady(ctx context.Context) error {
	var lastErr error
	for {
		select {
		case <-s.proc.Exited():
			return fmt.Errorf("exited: %v", s.proc.ExitErr())
		default:
		}
		if c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(s.port), time.Second); err == nil {
			c.Close()
			actx, cancel := context.WithTimeout(ctx, 2*time.Second)
			_, lastErr = jetStreamReady(actx, s.URL)
			cancel()
			if lastErr == nil {
				return nil
			}
		} else {
			lastErr = err
		}
		select {
		case <-ctx.Done():
			return errors.Join(ctx.Err(), lastErr)
		case <-time.After(25 * time.Millisecond):
		}
	}
}

// Stop shuts the server down gracefully (SIGTERM; SIGKILL after 10 s).
func (s *NATSServer) Stop() {
	if p := s.current(); p != nil {
		p.Stop()
	}
}

// Kill ends the server with SIGKILL: no flush, no goodbye to clients.
func (s *NATSServer) Kill() {
	if p := s.current(); p != nil {
		p.Kill()
	}
}

// Process is the current server process, for tests that pause it.
func (s *NATSServer) Process() *Process { return s.current() }

func (s *NATSServer) current() *Process {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc
}
