package bench

import (
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"runtime/pprof"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

// RelayShareResult is the relay's share of a worker's CPU at full load.
type RelayShareResult struct {
	Records   int64
	Passes    int           // the runs over the topic it took to gather MinWorkerCPU
	Elapsed   time.Duration // summed over the passes: from the first commit to the outbox being empty
	WorkerCPU time.Duration // the worker's goroutines, the relay's included
	RelayCPU  time.Duration // the relay's goroutines (outbox.ProfileLabelKey = outbox.ProfileLabelValue)
	Share     float64       // RelayCPU / WorkerCPU
}

func (r RelayShareResult) String() string {
	return fmt.Sprintf("relay share of the worker's CPU: %.1f%% (relay %v of %v over %d records in %d passes, %v, %.0f records/s; %d profile samples)",
		100*r.Share, r.RelayCPU.Round(time.Millisecond), r.WorkerCPU.Round(time.Millisecond), r.Records, r.Passes,
		r.Elapsed.Round(time.Millisecond), float64(r.Records)/r.Elapsed.Seconds(), r.WorkerCPU/profilePeriod)
}

// workerLabel marks the goroutines of the worker under measurement; the
// relay's own label overrides it on the relay's goroutines.
const workerLabel = "worker"

const (
	// profilePeriod is the sampling period of runtime/pprof's CPU profile
	// (100 Hz): a share measured over a few samples is noise.
	profilePeriod = 10 * time.Millisecond
	// MinWorkerCPU is the worker CPU a relay share is measured over: 50
	// samples. A small topic is run over again until the profile holds it.
	MinWorkerCPU = 50 * profilePeriod
	// maxRelaySharePasses bounds the runs over a small topic.
	maxRelaySharePasses = 50
)

// RelayShare runs cfg.Function's exactly-once worker with its outbox relay
// over the cfg.Records records of its topic, as fast as it goes, under a
// CPU profile of this process, until every record is applied and the
// outbox is empty. It returns the CPU time of the worker's goroutines and,
// among them, of the relay's (told apart by pprof labels), so other work
// in the process (an in-process broker, the benchmark itself) counts in
// neither. The relay's share is its cost inside the worker: Postgres and
// NATS work for it in their own processes.
//
// A topic applied in less than MinWorkerCPU is run over again, each pass
// as a function of its own name (a fresh inbox and cursor), until the
// profiles hold MinWorkerCPU of the worker: 400 records take a few tens of
// milliseconds, which a 100 Hz profile may not sample at all.
func RelayShare(ctx context.Context, cfg Config) (RelayShareResult, error) {
	wcfg := cfg.Worker
	wcfg.NoRelay = false
	pool, err := pgxpool.New(ctx, wcfg.DatabaseURL)
	if err != nil {
		return RelayShareResult{}, fmt.Errorf("relay share: %w", err)
	}
	defer pool.Close()

	var res RelayShareResult
	for res.WorkerCPU < MinWorkerCPU && res.Passes < maxRelaySharePasses {
		fn := cfg.Function
		fn.Name = fmt.Sprintf("%s-relayshare-%d", cfg.Function.Name, time.Now().UnixNano())
		cpu, err := CPUByLabel(outbox.ProfileLabelKey, func() error {
			records, elapsed, err := runWithRelay(ctx, wcfg, fn, cfg.Records, pool)
			res.Records += records
			res.Elapsed += elapsed
			return err
		})
		if err != nil {
			return RelayShareResult{}, err
		}
		res.Passes++
		res.RelayCPU += cpu[outbox.ProfileLabelValue]
		res.WorkerCPU += cpu[workerLabel] + cpu[outbox.ProfileLabelValue]
	}
	if res.WorkerCPU < MinWorkerCPU {
		return RelayShareResult{}, fmt.Errorf("relay share: %d passes over %d records used %v of the worker's CPU, under the %v a share is measured over",
			res.Passes, cfg.Records, res.WorkerCPU, MinWorkerCPU)
	}
	res.Share = float64(res.RelayCPU) / float64(res.WorkerCPU)
	return res, nil
}

// runWithRelay runs the worker, its goroutines labelled, until it has
// applied records records and the outbox is empty.
func runWithRelay(ctx context.Context, wcfg runtime.Config, fn runtime.Function, records int64, pool *pgxpool.Pool) (int64, time.Duration, error) {
	var (
		wk  *engine.Worker
		err error
	)
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	pprof.Do(runCtx, pprof.Labels(outbox.ProfileLabelKey, workerLabel), func(ctx context.Context) {
		if wk, err = engine.NewWorker(ctx, wcfg, fn); err != nil {
			return
		}
		go func() { done <- wk.Run(ctx) }()
	})
	if err != nil {
		return 0, 0, err
	}
	defer func() {
		stop()
		<-done
	}()
	var start time.Time
	var before int64
	for {
		applied := wk.Stats().Applied.Load()
		if start.IsZero() && applied > 0 {
			start, before = time.Now(), applied
		}
		if applied >= records {
			var left int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM kfn.outbox`).Scan(&left); err != nil {
				return 0, 0, fmt.Errorf("relay share: %w", err)
			}
			if left == 0 {
				return applied - before, time.Since(start), nil
			}
		}
		select {
		case <-ctx.Done():
			return 0, 0, ctx.Err()
		case err := <-done:
			return 0, 0, fmt.Errorf("relay share: the worker stopped: %w", err)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// CPUByLabel profiles this process's CPU while run runs and returns the CPU
// time of the samples by the value of their pprof label key ("" for samples
// without it). Only one CPU profile can run in a process at a time.
func CPUByLabel(key string, run func() error) (map[string]time.Duration, error) {
	var buf bytes.Buffer
	if err := pprof.StartCPUProfile(&buf); err != nil {
		return nil, fmt.Errorf("start a CPU profile: %w", err)
	}
	runErr := run()
	pprof.StopCPUProfile()
	if runErr != nil {
		return nil, runErr
	}
	return cpuByLabel(&buf, key)
}

// cpuByLabel sums the CPU nanoseconds of a gzipped pprof CPU profile by
// the value of label key. It reads the few fields it needs of the
// profile.proto messages: Profile.sample (2) and string_table (6);
// Sample.value (2, [samples, nanoseconds] in a CPU profile) and label (3);
// Label.key (1) and str (2), both string table indexes.
func cpuByLabel(r io.Reader, key string) (map[string]time.Duration, error) {
	zr, err := gzip.NewReader(r)
	if err != nil {
		return nil, fmt.Errorf("read the CPU profile: %w", err)
	}
	raw, err := io.ReadAll(zr)
	if err != nil {
		return nil, fmt.Errorf("read the CPU profile: %w", err)
	}
	type sample struct {
		nanos  int64
		labels [][2]int64 // key, str
	}
	var samples []sample
	var strs []string
	err = eachField(raw, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		switch {
		case num == 6 && typ == protowire.BytesType:
			strs = append(strs, string(v))
		case num == 2 && typ == protowire.BytesType:
			var s sample
			var values []int64
			err := eachField(v, func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error {
				switch {
				case num == 2 && typ == protowire.BytesType: // packed values
					for len(v) > 0 {
						x, n := protowire.ConsumeVarint(v)
						if n < 0 {
							return protowire.ParseError(n)
						}
						values, v = append(values, int64(x)), v[n:]
					}
				case num == 2 && typ == protowire.VarintType:
					values = append(values, int64(x))
				case num == 3 && typ == protowire.BytesType:
					var l [2]int64
					err := eachField(v, func(num protowire.Number, typ protowire.Type, _ []byte, x uint64) error {
						if typ == protowire.VarintType && (num == 1 || num == 2) {
							l[num-1] = int64(x)
						}
						return nil
					})
					if err != nil {
						return err
					}
					s.labels = append(s.labels, l)
				}
				return nil
			})
			if err != nil {
				return err
			}
			if len(values) > 0 {
				s.nanos = values[len(values)-1]
			}
			samples = append(samples, s)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the CPU profile: %w", err)
	}
	str := func(i int64) string {
		if i < 0 || i >= int64(len(strs)) {
			return ""
		}
		return strs[i]
	}
	out := map[string]time.Duration{}
	for _, s := range samples {
		value := ""
		for _, l := range s.labels {
			if str(l[0]) == key {
				value = str(l[1])
			}
		}
		out[value] += time.Duration(s.nanos)
	}
	return out, nil
}

// eachField calls f for every field of a protobuf message: its number, its
// wire type, and its bytes (length-delimited fields) or value (varints).
func eachField(b []byte, f func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		var v []byte
		var x uint64
		switch typ {
		case protowire.VarintType:
			x, n = protowire.ConsumeVarint(b)
		case protowire.BytesType:
			v, n = protowire.ConsumeBytes(b)
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if err := f(num, typ, v, x); err != nil {
			return err
		}
	}
	return nil
}
