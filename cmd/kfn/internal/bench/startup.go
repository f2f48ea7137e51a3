package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/internal/engine"
)

// StartupConfig is a start-up measurement: a function binary started
// Starts times, one after the other, against running services with records
// waiting on its topic.
type StartupConfig struct {
	// Binary is the function's binary, built before: its build is not timed.
	Binary string
	// Env is the binary's environment: its settings (DATABASE_URL,
	// KFN_NATS_URL, KFN_KAFKA_BROKERS…), on top of none of this process's.
	Env []string
	// Starts is how many starts are timed. One more start comes first,
	// untimed: it creates what a function's first start ever creates (the
	// lease bucket, the event stream, its cursors), which a start from zero
	// finds in place.
	Starts int
	// Produce puts records on the function's topic before each start
	// (round 0 is the untimed one), enough that every partition has some.
	Produce func(ctx context.Context, round int) error
	// Settled, called after a start's first commit and before it is
	// stopped, returns once every record produced so far is applied: each
	// start then finds exactly its round's records waiting.
	Settled func(ctx context.Context) error
	// Timeout bounds each start (default 30 s): a start that logs no
	// first commit by then is an error, with the tail of its log.
	Timeout time.Duration
}

// StartupPhase is one phase of a start, from the binary's exec: when it
// began and ended.
type StartupPhase struct {
	Name     string
	From, To time.Duration
}

// Start is one timed start: from the exec of the binary to the first
// commit's log line, and its phases. The first phase, "exec", runs from the
// exec to the worker's construction (engine.NewWorker): the Go runtime, the
// packages' initialisation, the flags and the logger.
type Start struct {
	FirstCommit time.Duration
	Phases      []StartupPhase
}

// StartupResult is a start-up measurement's starts and their medians.
type StartupResult struct {
	Starts   []Start
	P50, P90 time.Duration
	// Phases are the phases' medians (of From and of To, each over the
	// starts that logged the phase), in the order of their median end.
	Phases []StartupPhase
}

// StartupGoal is the bound the start → first commit p50 is held to (issue
// 28): a function scaled from zero pays it on every start.
const StartupGoal = 250 * time.Millisecond

func (r StartupResult) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "start → first commit: p50 %s  p90 %s  over %d starts (goal <= %.2f s)\n",
		r.P50.Round(time.Millisecond), r.P90.Round(time.Millisecond), len(r.Starts), StartupGoal.Seconds())
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  PHASE (median)\tFROM\tTO\tTOOK")
	for _, p := range r.Phases {
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", p.Name, ms(p.From), ms(p.To), ms(p.To-p.From))
	}
	tw.Flush()
	return b.String()
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond)) }

// Startup runs cfg.Binary cfg.Starts (+1 untimed) times. Each start
// execs the binary with records waiting on its topic, reads its log (JSON
// lines on stderr) until the first commit's line (engine.FirstCommitMsg),
// then stops it with SIGTERM and waits for its exit: its clean handoff
// releases the leases, so that the next start, like a function scaled from
// zero, finds no owner in its way.
func Startup(ctx context.Context, cfg StartupConfig) (StartupResult, error) {
	if cfg.Starts < 1 {
		return StartupResult{}, errors.New("startup: Starts must be at least 1")
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 30 * time.Second
	}
	var res StartupResult
	for round := range cfg.Starts + 1 {
		if err := cfg.Produce(ctx, round); err != nil {
			return StartupResult{}, fmt.Errorf("startup: produce records before start %d: %w", round, err)
		}
		s, err := startOnce(ctx, cfg)
		if err != nil {
			return StartupResult{}, fmt.Errorf("startup: start %d: %w", round, err)
		}
		if round > 0 {
			res.Starts = append(res.Starts, s)
		}
	}
	return Summarize(res.Starts), nil
}

// Summarize gives the medians of starts.
func Summarize(starts []Start) StartupResult {
	res := StartupResult{Starts: starts}
	totals := make([]time.Duration, len(starts))
	froms, tos := map[string][]time.Duration{}, map[string][]time.Duration{}
	for i, s := range starts {
		totals[i] = s.FirstCommit
		for _, p := range s.Phases {
			froms[p.Name] = append(froms[p.Name], p.From)
			tos[p.Name] = append(tos[p.Name], p.To)
		}
	}
	res.P50, res.P90 = quantile(totals, 0.5), quantile(totals, 0.9)
	for name := range froms {
		res.Phases = append(res.Phases, StartupPhase{Name: name, From: quantile(froms[name], 0.5), To: quantile(tos[name], 0.5)})
	}
	slices.SortFunc(res.Phases, func(a, b StartupPhase) int {
		if a.To != b.To {
			return int(a.To - b.To)
		}
		return int(a.From - b.From)
	})
	return res
}

// quantile is the q-quantile of ds (nearest rank).
func quantile(ds []time.Duration, q float64) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.999999) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// startOnce execs the binary and times its start to the first commit.
func startOnce(ctx context.Context, cfg StartupConfig) (Start, error) {
	cmd := exec.Command(cfg.Binary)
	cmd.Env = cfg.Env
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return Start{}, err
	}
	execAt := time.Now()
	if err := cmd.Start(); err != nil {
		return Start{}, fmt.Errorf("exec %s: %w", cfg.Binary, err)
	}
	lines := make(chan string, 64)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			lines <- sc.Text()
		}
		_, _ = io.Copy(io.Discard, stderr)
	}()
	var tail []string
	stop := func() error {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		for l := range lines {
			tail = append(tail, l)
		}
		return cmd.Wait()
	}
	timeout := time.NewTimer(cfg.Timeout)
	defer timeout.Stop()
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				err := cmd.Wait()
				return Start{}, fmt.Errorf("the process ended (%v) before its first commit; its log ends:\n%s", err, lastLines(tail))
			}
			tail = append(tail, l)
			s, found, perr := firstCommit(l, execAt)
			if !found {
				continue
			}
			settleCtx, cancel := context.WithTimeout(ctx, cfg.Timeout)
			serr := cfg.Settled(settleCtx)
			cancel()
			if err := stop(); err != nil || serr != nil {
				return Start{}, fmt.Errorf("after its first commit, the process did not apply every record (%v) or stop cleanly (%v); its log ends:\n%s", serr, err, lastLines(tail))
			}
			return s, perr
		case <-timeout.C:
			_ = cmd.Process.Kill()
			_ = stop()
			return Start{}, fmt.Errorf("no first commit logged within %s; its log ends:\n%s", cfg.Timeout, lastLines(tail))
		case <-ctx.Done():
			_ = stop()
			return Start{}, ctx.Err()
		}
	}
}

func lastLines(lines []string) string {
	return strings.Join(lines[max(len(lines)-200, 0):], "\n")
}

// firstCommit reads a worker's log line: found when it is the first
// commit's, whose start (phases from the exec at execAt) it returns.
func firstCommit(line string, execAt time.Time) (Start, bool, error) {
	var l struct {
		Time   time.Time                    `json:"time"`
		Msg    string                       `json:"msg"`
		After  string                       `json:"after"`
		Phases map[string]map[string]string `json:"phases"`
	}
	if json.Unmarshal([]byte(line), &l) != nil || l.Msg != engine.FirstCommitMsg {
		return Start{}, false, nil
	}
	after, err := time.ParseDuration(l.After)
	if err != nil {
		return Start{}, true, fmt.Errorf("first commit line: after %q: %w", l.After, err)
	}
	worker := l.Time.Add(-after).Sub(execAt) // from the exec to NewWorker
	s := Start{FirstCommit: l.Time.Sub(execAt), Phases: []StartupPhase{{Name: "exec", To: worker}}}
	for name, p := range l.Phases {
		from, ferr := time.ParseDuration(p["from"])
		to, terr := time.ParseDuration(p["to"])
		if err := errors.Join(ferr, terr); err != nil {
			return Start{}, true, fmt.Errorf("first commit line: phase %s: %w", name, err)
		}
		s.Phases = append(s.Phases, StartupPhase{Name: name, From: worker + from, To: worker + to})
	}
	return s, true, nil
}

// StartupEnv is the environment of a function binary under Startup:
// settings (NAME=value) over the PATH and HOME of this process, nothing
// else of it (a KFN_ variable here must not change the measured start).
func StartupEnv(settings ...string) []string {
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	return append(env, settings...)
}

// AllApplied returns once fn's cursors on topic have reached every
// partition's high watermark (highs reads them from Kafka), polling every
// 10 ms until ctx ends.
func AllApplied(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, fn, topic string, highs func(context.Context, string) (map[int]int64, error)) error {
	for {
		hw, err := highs(ctx, topic)
		if err != nil {
			return err
		}
		var want int64
		for _, h := range hw {
			want += h
		}
		var got int64
		if err := db.QueryRow(ctx, `SELECT coalesce(sum(next_offset), 0) FROM kfn.cursors WHERE consumer = $1 AND topic = $2`, fn, topic).Scan(&got); err != nil {
			return err
		}
		if got >= want {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d of %d records applied: %w", got, want, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}
