package process

import (
	"fmt"
	"log/slog"
	"math"
	"os"
	"runtime/debug"

	"github.com/KimMachineGun/automemlimit/memlimit"
)

// setMemoryLimit sets the Go memory limit of a function process from its
// container's memory limit (the cgroup's, read by automemlimit): 90% of
// it, so that the garbage collector works harder before the kernel's OOM
// killer comes, leaving the rest to what Go does not count (stacks of
// threads, the binary). GOMEMLIMIT, when set, wins and is kept as it is;
// AUTOMEMLIMIT sets another ratio, or "off". It logs what it chose.
func setMemoryLimit(log *slog.Logger) {
	if v, ok := os.LookupEnv("GOMEMLIMIT"); ok {
		log.Info("memory limit from GOMEMLIMIT", "go_memory_limit", inMiB(debug.SetMemoryLimit(-1)), "GOMEMLIMIT", v)
		return
	}
	container, cgErr := memlimit.FromCgroup()
	limit, err := memlimit.Set(memlimit.WithProvider(memlimit.FromCgroup))
	switch {
	case err != nil:
		log.Info("memory limit: none (the container's limit cannot be read; set GOMEMLIMIT to choose one)", "err", err)
	case limit == math.MaxInt64 || cgErr != nil:
		log.Info("memory limit: none (no container memory limit, or AUTOMEMLIMIT=off; set GOMEMLIMIT to choose one)")
	default:
		log.Info("memory limit set from the container's", "go_memory_limit", inMiB(limit), "container_limit", inMiB(int64(container)))
	}
}

// inMiB formats bytes as whole mebibytes: "230 MiB".
func inMiB(bytes int64) string { return fmt.Sprintf("%d MiB", bytes>>20) }
