package outbox_test

import (
	"context"
	"log/slog"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/outbox"
)

// A relay process: it forwards every committed outbox row to the stream
// KFN_EVENTS (created if missing) until interrupted. Functions write the
// rows with outbox.Insert inside their own transactions.
func ExampleRelay() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	nc, err := nats.Connect(os.Getenv("NATS_URL"), nats.MaxReconnects(-1))
	if err != nil {
		panic(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		panic(err)
	}

	relay, err := outbox.NewRelay(outbox.RelayConfig{
		Pool:      pool,
		JetStream: js,
		Subjects:  []string{"orders.>"},
		Logger:    slog.Default(),
	})
	if err != nil {
		panic(err) // a *outbox.RelayConfigError names the bad field
	}
	if err := relay.Run(ctx); err != nil {
		panic(err) // e.g. *outbox.StreamMismatchError
	}
	stats := relay.Stats()
	slog.Info("relay stopped", "published", stats.Published, "last_latency", stats.LastLatency)
}
