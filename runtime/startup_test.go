package runtime_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/worker"
)

func TestUnreachableServicesGiveAClearError(t *testing.T) {
	b := setup(t, 1)
	fn := effects.Function(b.fn, b.topic)
	cases := []struct {
		name string
		edit func(*runtime.Config)
		want string
	}{
		{"postgres", func(c *runtime.Config) { c.DatabaseURL = "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=2" }, "cannot reach Postgres at postgres://postgres@127.0.0.1:1/postgres"},
		{"kafka", func(c *runtime.Config) { c.KafkaBrokers = []string{"127.0.0.1:1"} }, "cannot reach Kafka at 127.0.0.1:1"},
		{"nats", func(c *runtime.Config) { c.NATSURL = "nats://127.0.0.1:1" }, "cannot reach NATS at nats://127.0.0.1:1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := b.cfg
			tc.edit(&cfg)
			_, err := worker.New(context.Background(), cfg, fn)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestWorkerRefusesAMissingOrNewerSchema(t *testing.T) {
	b := setup(t, 1)
	fn := effects.Function(b.fn, b.topic)
	ctx := context.Background()

	// A newer schema whose newer migration breaks this binary, as a newer
	// migrator records it.
	execSQL(t, b, `INSERT INTO kfn.schema_migrations (version, name, breaks_before) VALUES ($1, 'newer', $1)`, schema.Latest()+1)
	_, err := worker.New(ctx, b.cfg, fn)
	var verr *schema.VersionError
	if !errors.As(err, &verr) || !strings.Contains(err.Error(), "upgrade this binary") {
		t.Errorf("newer schema: err = %v, want a *schema.VersionError telling to upgrade the binary", err)
	}

	execSQL(t, b, `DROP SCHEMA kfn CASCADE`)
	_, err = worker.New(ctx, b.cfg, fn)
	if !errors.Is(err, schema.ErrSchemaMissing) || !strings.Contains(err.Error(), "kfn migrate") {
		t.Errorf("missing schema: err = %v, want ErrSchemaMissing telling to run kfn migrate", err)
	}

	applied, err := schema.Migrate(ctx, b.pg.Pool)
	if err != nil || len(applied) != len(schema.Migrations()) {
		t.Fatalf("migrate = %v, %v; want every migration applied", applied, err)
	}
	_, stop := b.run(t, fn) // fails the test if the worker does not start
	stop()
}

func TestWorkersStartingTogetherAllSucceed(t *testing.T) {
	b := setup(t, 1)
	fn := effects.Function(b.fn, b.topic)
	const workers = 6
	errs := make(chan error, workers)
	for i := range workers {
		go func() {
			cfg := b.cfg
			cfg.WorkerID = fmt.Sprintf("w%d", i)
			w, err := worker.New(context.Background(), cfg, fn)
			if err == nil {
				w.Close()
			}
			errs <- err
		}()
	}
	for range workers {
		if err := <-errs; err != nil {
			t.Errorf("a worker starting at the same time as others failed: %v", err)
		}
	}
}
