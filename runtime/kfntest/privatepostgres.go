package kfntest

import (
	"context"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/devstack"
)

// PrivatePostgres is a Postgres server of one test's own, a throwaway
// cluster from the local binaries even when KFN_TEST_DATABASE_URL names a
// server, for fault tests that stop and start Postgres (the shared server
// must stay up for the other tests) and for deployments that spread
// functions over servers. PG is a migrated database on it.
type PrivatePostgres struct {
	*PG
	// Port is the server's port on 127.0.0.1; Start keeps it.
	Port int

	server *devstack.Postgres
}

// NewPrivatePostgres starts a cluster on a free port, creates and migrates
// a database on it, and stops the cluster (removing its data) when the
// test ends.
func NewPrivatePostgres(t testing.TB) *PrivatePostgres {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	server, err := devstack.StartPostgres(ctx, devstack.PostgresOptions{Logger: logger})
	if err != nil {
		t.Fatalf("kfntest: start a private Postgres server: %v", err)
	}
	t.Cleanup(func() {
		if err := server.Stop(); err != nil {
			t.Errorf("kfntest: stop the private Postgres server: %v", err)
		}
	})
	srv, err := connectServer(ctx, server.URL)
	if err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	t.Cleanup(srv.admin.Close)
	pg, err := createDatabase(srv, databaseName(t), true)
	if pg != nil && pg.Pool != nil {
		t.Cleanup(pg.Pool.Close)
	}
	if err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	return &PrivatePostgres{PG: pg, Port: server.Port, server: server}
}

// Stop shuts the server down (a fast shutdown: open transactions roll
// back, every connection is dropped) and keeps its data, until Start.
func (p *PrivatePostgres) Stop() error { return p.server.Shutdown() }

// Start starts the stopped server again on the same port, with its data.
func (p *PrivatePostgres) Start() error {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	return p.server.Start(ctx)
}
