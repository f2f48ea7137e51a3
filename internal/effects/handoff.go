package effects

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ClaimedAt returns when owner claimed each partition of fn's topic that it
// owns now: kfn.cursors.claimed_at, the start of its claim's transaction
// (the clock of the Postgres server). Fault tests measure handoffs with it.
func ClaimedAt(ctx context.Context, pool *pgxpool.Pool, fn, topic, owner string) (map[int]time.Time, error) {
	rows, err := pool.Query(ctx,
		`SELECT partition, claimed_at FROM kfn.cursors WHERE consumer = $1 AND topic = $2 AND owner = $3`, fn, topic, owner)
	if err != nil {
		return nil, fmt.Errorf("read the claims of %s: %w", owner, err)
	}
	out := map[int]time.Time{}
	var p int
	var at time.Time
	_, err = pgx.ForEachRow(rows, []any{&p, &at}, func() error {
		out[p] = at
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the claims of %s: %w", owner, err)
	}
	return out, nil
}
