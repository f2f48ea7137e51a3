package engine

import (
	"context"
	"fmt"
	"math"
	"runtime/debug"
	"time"

	"github.com/kfn-dev/kfn/internal/kafkasource"
	"github.com/kfn-dev/kfn/internal/settings"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// A worker's memory is bounded in bytes, lane by lane. A lane holds the
// batch it applies and the next one it reads meanwhile (the prefetch),
// each up to --batch-max-bytes plus the record that took it there (at most
// --max-record-bytes for a record the handler sees), and its reader holds
// one fetch response, of at most the smaller of 1 MiB and
// --batch-max-bytes, twice at worst: as it arrives and as its records. So
// a lane holds at most laneMemory, and a worker that owns n lanes at most
// n × laneMemory + baseMemory.

// baseMemory is what a worker holds besides its lanes' records: the Go
// runtime, the clients of Kafka, Postgres and NATS, the relay, metrics,
// with room to spare.
const baseMemory = 32 << 20

// fetchBytes is the bound of a lane's fetch response.
func fetchBytes(cfg kfn.Config) int {
	return min(cfg.BatchMaxBytes, kafkasource.MaxFetchBytes)
}

// laneMemory is the most a lane holds in records, in bytes.
func laneMemory(cfg kfn.Config) int64 {
	return 2*int64(cfg.BatchMaxBytes+cfg.MaxRecordBytes) + 2*int64(fetchBytes(cfg))
}

// checkMemory says, at start, when the lanes this worker may own cannot
// fit its Go memory limit: every partition of its Kafka functions' topics
// (which one worker owns when it runs alone) and the lanes of its NATS
// functions, each holding up to laneMemory. It names the flags that
// bound a lane. Without a memory limit it says nothing.
func (w *worker) checkMemory(ctx context.Context) {
	limit := debug.SetMemoryLimit(-1)
	if limit == math.MaxInt64 {
		return
	}
	lanes := 0
	for _, fn := range w.fns {
		if fn.Topic == "" {
			lanes += w.cfg.Lanes
			continue
		}
		mctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		parts, err := w.kafka.Partitions(mctx, fn.Topic)
		cancel()
		if err != nil {
			continue // a missing topic is reported by readiness
		}
		lanes += len(parts)
	}
	per := laneMemory(w.cfg)
	need := int64(lanes)*per + baseMemory
	attrs := []any{"lanes", lanes, "per_lane", mib(per), "need", mib(need), "go_memory_limit", mib(limit)}
	if need <= limit {
		w.cfg.Logger.Debug("memory: the lanes fit the memory limit", attrs...)
		return
	}
	w.cfg.Logger.Warn(fmt.Sprintf("memory: %d lanes × %s (two batches of --%s %s, each plus a record of --%s %s, and a fetch of %s held twice) + %s = %s, over the Go memory limit of %s: "+
		"a worker that owns every lane can run out of memory; lower --%s (%s) or --%s (%s), run more workers, or give each more memory",
		lanes, mib(per), settings.BatchMaxBytes.Flag, mib(int64(w.cfg.BatchMaxBytes)), settings.MaxRecordBytes.Flag, mib(int64(w.cfg.MaxRecordBytes)), mib(int64(fetchBytes(w.cfg))),
		mib(baseMemory), mib(need), mib(limit),
		settings.BatchMaxBytes.Flag, settings.BatchMaxBytes.Env, settings.MaxRecordBytes.Flag, settings.MaxRecordBytes.Env), attrs...)
}

// mib formats bytes in mebibytes: "230 MiB", "1.5 MiB".
func mib(bytes int64) string {
	m := float64(bytes) / (1 << 20)
	if m >= 10 || m == math.Trunc(m) {
		return fmt.Sprintf("%.0f MiB", m)
	}
	return fmt.Sprintf("%.1f MiB", m)
}
