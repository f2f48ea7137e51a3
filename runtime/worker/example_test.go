package worker_test

import (
	"context"
	"encoding/json"
	"flag"
	"log"
	"net/http"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// A function's main: configuration comes from flags and KFN_* variables,
// SIGTERM stops it after the in-flight batch. (Not run by go test: it
// needs Kafka, Postgres and NATS.)
func ExampleStart() {
	worker.Start(runtime.Function{
		Name:  "orders",
		Topic: "orders",
		Emits: []string{"orders.accepted"},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (order_id text PRIMARY KEY)`)
			return err
		},
		BatchHandler: func(ctx context.Context, tx pgx.Tx, recs []runtime.Record, out *runtime.BatchEvents) error {
			var ids []string
			for _, rec := range recs {
				var o struct {
					ID string `json:"order_id"`
				}
				if err := json.Unmarshal(rec.Value, &o); err != nil {
					out.Reject(rec, err) // dead-lettered at once, with the reason; the batch goes on
					continue
				}
				ids = append(ids, o.ID)
				out.Emit(rec, runtime.Event{Subject: "orders.accepted", Key: o.ID, Data: rec.Value})
			}
			_, err := tx.Exec(ctx, `INSERT INTO orders (order_id) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING`, ids)
			return err // an error rolls the batch back: kfn retries it record by record to find the culprit
		},
	})
}

// Several functions in one process of your own: bind the worker's settings
// to your flags (or fill the Config in), run the worker until a signal,
// and serve its metrics and health checks. (Not run by go test: it needs
// Kafka, Postgres and NATS.)
func ExampleNew() {
	var cfg runtime.Config
	cfg.Bind(flag.CommandLine) // --kafka-brokers, --database-url, --nats-url… and their KFN_* variables
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	w, err := worker.New(ctx, cfg, ordersFunction, ledgerFunction)
	if err != nil {
		log.Fatal(err) // a bad setting names its flag and its variable
	}
	go http.ListenAndServe(":9090", w.HTTPHandler()) // /metrics, /healthz, /readyz
	if err := w.Run(ctx); err != nil {
		log.Print(err)
		os.Exit(1)
	}
	log.Printf("applied %d records", w.Stats().Applied.Load())
}

var ordersFunction, ledgerFunction runtime.Function
