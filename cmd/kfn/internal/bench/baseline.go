package bench

import (
	"context"

	"github.com/kfn-dev/kfn/internal/engine"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// newAtLeastOnceWorker is engine.NewWorker turned into the benchmark's
// baseline (Worker.AtLeastOnceBaseline): the same batching and
// transactions without the inbox claim and the fenced cursor move, so the
// difference to exactly-once is what those cost. Never a production mode.
func newAtLeastOnceWorker(ctx context.Context, cfg kfn.Config, fns ...kfn.Function) (*engine.Worker, error) {
	wk, err := engine.NewWorker(ctx, cfg, fns...)
	if err != nil {
		return nil, err
	}
	wk.AtLeastOnceBaseline()
	return wk, nil
}
