// Command effects-worker runs the effects test function as a real process,
// for fault tests that kill, pause and restart workers. The function name and
// topic come from KFN_TEST_FUNCTION and KFN_TEST_TOPIC.
//
// `effects-worker migrate` instead applies the schema migrations this build
// knows to DATABASE_URL, as `kfn migrate` of the same release would: the
// rolling-upgrade test builds it for several schema versions (see
// internal/schema's maxVersion and the kfn_upgrade_test build tag).
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/runtime/worker"
)

func main() {
	if len(os.Args) == 2 && os.Args[1] == "migrate" {
		if err := migrate(); err != nil {
			fmt.Fprintln(os.Stderr, "effects-worker migrate:", err)
			os.Exit(1)
		}
		return
	}
	name, topic := os.Getenv("KFN_TEST_FUNCTION"), os.Getenv("KFN_TEST_TOPIC")
	if name == "" || topic == "" {
		fmt.Fprintln(os.Stderr, "effects-worker: set KFN_TEST_FUNCTION and KFN_TEST_TOPIC")
		os.Exit(2)
	}
	worker.Start(effects.Function(name, topic))
}

func migrate() error {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return err
	}
	defer pool.Close()
	applied, err := schema.Migrate(ctx, pool)
	if err != nil {
		return err
	}
	fmt.Printf("applied migrations %v; schema is at version %d\n", applied, schema.Latest())
	return nil
}
