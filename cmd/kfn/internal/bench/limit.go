package bench

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Writer makes the rows of records [first, first+n), for a limit mode
// (Config.Limit or Config.WALLimit), and returns what writes them inside
// a transaction. The rows are made before the limit's clock starts: a
// limit times Postgres taking them, not the client making them.
type Writer func(ctx context.Context, pool *pgxpool.Pool, consumer string, first, n int64) (write func(context.Context, pgx.Tx) error, err error)

// LimitSetting is how a limit mode writes: records per transaction and
// connections writing at once.
type LimitSetting struct {
	Batch       int
	Connections int
}

func (s LimitSetting) String() string {
	return fmt.Sprintf("batch %d × %d connections", s.Batch, s.Connections)
}

// SweepPoint is one setting a limit tried, and the rate it reached.
type SweepPoint struct {
	LimitSetting
	PerSecond float64
}

// LimitBatches are the batch sizes a limit sweeps.
var LimitBatches = []int{500, 1000, 2000, 5000}

// limitSettings are the settings a limit sweeps: every batch size of
// LimitBatches with 1, 2, 4, … connections up to twice the partitions,
// the partitions and twice the partitions included.
func limitSettings(partitions int) []LimitSetting {
	var conns []int
	for c := 1; c < 2*partitions; c *= 2 {
		conns = append(conns, c)
	}
	conns = appendSorted(appendSorted(conns, partitions), 2*partitions)
	var out []LimitSetting
	for _, b := range LimitBatches {
		for _, c := range conns {
			out = append(out, LimitSetting{Batch: b, Connections: c})
		}
	}
	return out
}

// appendSorted inserts v into the sorted s unless it is there.
func appendSorted(s []int, v int) []int {
	for i, x := range s {
		if x == v {
			return s
		}
		if x > v {
			return append(s[:i], append([]int{v}, s[i:]...)...)
		}
	}
	return append(s, v)
}

// benchLimit is a limit mode: it writes every record with the Writer
// writer picks from the config, at each setting of limitSettings (the
// tables emptied before each), and reports the fastest setting's round as
// the mode's: a ceiling the other modes are held to is the best this
// Postgres did, not one setting's figure.
func benchLimit(writer func(*Config) Writer) func(context.Context, *Config, string) (round, error) {
	return func(ctx context.Context, cfg *Config, consumer string) (round, error) {
		write := writer(cfg)
		var best round
		var sweep []SweepPoint
		for i, s := range limitSettings(max(1, cfg.Partitions)) {
			if i > 0 {
				if err := benchReset(ctx, *cfg); err != nil {
					return round{}, err
				}
			}
			cfg.done.Store(0)
			r, err := writeRecords(ctx, cfg, write, fmt.Sprintf("%s-%d", consumer, i), s)
			if err != nil {
				return round{}, fmt.Errorf("%s: %w", s, err)
			}
			rate := float64(r.records) / r.elapsed.Seconds()
			sweep = append(sweep, SweepPoint{LimitSetting: s, PerSecond: rate})
			if best.records == 0 || rate > float64(best.records)/best.elapsed.Seconds() {
				best = r
			}
		}
		best.sweep = sweep
		return best, nil
	}
}

// writeRecords writes every record with write at setting s: the records
// split in as many ranges as connections, each range in transactions of
// s.Batch records.
func writeRecords(ctx context.Context, cfg *Config, write Writer, consumer string, s LimitSetting) (round, error) {
	poolCfg, err := pgxpool.ParseConfig(cfg.Worker.DatabaseURL)
	if err != nil {
		return round{}, err
	}
	poolCfg.MaxConns = int32(s.Connections)
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return round{}, err
	}
	defer pool.Close()
	conns := int64(s.Connections)
	per := (cfg.Records + conns - 1) / conns
	batch := int64(s.Batch)
	type batchWrite struct {
		n     int64
		write func(context.Context, pgx.Tx) error
	}
	writes := make([][]batchWrite, conns) // each connection's transactions
	for k := range conns {
		for i := k * per; i < min(cfg.Records, (k+1)*per); i += batch {
			n := min(batch, min(cfg.Records, (k+1)*per)-i)
			w, err := write(ctx, pool, consumer, i, n)
			if err != nil {
				return round{}, err
			}
			writes[k] = append(writes[k], batchWrite{n, w})
		}
	}
	// Every connection open before the clock starts.
	warm := make([]*pgxpool.Conn, 0, conns)
	for range conns {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			return round{}, err
		}
		warm = append(warm, conn)
	}
	for _, conn := range warm {
		conn.Release()
	}
	c := clock{procs: cfg.Processes}
	c.begin()
	errs := make(chan error, conns)
	for k := range conns {
		go func(txs []batchWrite) {
			for _, w := range txs {
				err := c.commits.timed(int(w.n), func() error {
					return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return w.write(ctx, tx) })
				})
				if err != nil {
					errs <- err
					return
				}
				cfg.done.Add(w.n)
			}
			errs <- nil
		}(writes[k])
	}
	var first error
	for range conns {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	if first != nil {
		return round{}, first
	}
	r := c.end(cfg.Records)
	r.setting = s
	return r, nil
}
