package devstack

import (
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// NATS is an in-process NATS server with JetStream enabled.
type NATS struct {
	URL     string
	server  *server.Server
	tempDir string
}

// StartNATS starts an embedded NATS server with JetStream on a free loopback
// port. JetStream state is kept in dir; an empty dir means a new temporary
// folder that Stop removes.
func StartNATS(dir string) (*NATS, error) {
	n := &NATS{}
	if dir == "" {
		tmp, err := os.MkdirTemp("", "kfn-nats-")
		if err != nil {
			return nil, fmt.Errorf("start NATS: make store dir: %w", err)
		}
		dir, n.tempDir = tmp, tmp
	}
	srv, err := server.NewServer(&server.Options{
		Host:      "127.0.0.1",
		Port:      server.RANDOM_PORT,
		JetStream: true,
		StoreDir:  dir,
		NoSigs:    true,
	})
	if err != nil {
		n.removeTemp()
		return nil, fmt.Errorf("start NATS: %w", err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		n.removeTemp()
		return nil, fmt.Errorf("start NATS: server not ready after 10s")
	}
	n.server = srv
	n.URL = srv.ClientURL()
	return n, nil
}

// Stop shuts the server down and removes its temporary store.
func (n *NATS) Stop() {
	n.server.Shutdown()
	n.server.WaitForShutdown()
	n.removeTemp()
}

func (n *NATS) removeTemp() {
	if n.tempDir != "" {
		os.RemoveAll(n.tempDir)
	}
}
