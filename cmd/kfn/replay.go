package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/user"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/runtime"
)

var replayHelp = help{
	usage: []string{"kfn replay --function F --topic T [--partition P] (--from-offset N | --from-time TIME) [--json] [flags]"},
	text: `
Moves partition cursors of a function back, through the workers' own lease
and fence, and writes kfn.audit_log. Every argument is checked for every
partition before any lease is taken; one refusal refuses the whole replay.

Idempotent (the default): the workers read the records from the new cursor
again and skip every one they handled before (the high-water mark and the
inbox say so). --to-offset changes nothing there: records below the
high-water mark are skipped whatever it says.

--reexecute --reason "…": the records in [from, to) are applied again. Their
inbox rows are deleted and the high-water mark drops to from; the handled
records from --to-offset on (up to the high-water mark) keep their inbox rows
(kfn writes back any that retention purged) and are skipped; records from the
high-water mark on were never handled and are applied as usual. Without
--to-offset, to is the high-water mark: everything handled from "from" on is
applied again. By default the re-executed records emit events with new ids
(the partition's generation grows), so downstream functions apply them again;
with --keep-event-ids they emit their original ids, and JetStream's duplicate
window and the downstream inboxes drop the events they already handled.

--dry-run prints, per partition, the range, how much of it was handled, what
would be re-executed and what downstream would see, and changes nothing.`,
	examples: `
kfn replay --function orders --topic orders --from-time 2026-03-01T09:00:00Z --dry-run
kfn replay --function orders --topic orders --from-time 2h --dry-run
kfn replay --function orders --topic orders --partition 2 --from-offset 200 --to-offset 400 \
  --reexecute --keep-event-ids --reason "INC-42: tax bug fixed" --wait`,
}

func runReplay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("replay", replayHelp, stderr)
	databases := bindDatabases(fs)
	natsURL := bind(fs, settings.NATSURL)
	natsSec := bindNATSSecurity(fs)
	brokersSetting := settings.KafkaBrokers
	brokersSetting.Usage += "; the range is checked against the records Kafka holds, and --from-time resolved there (required)"
	brokers := bind(fs, brokersSetting)
	sec := bindKafkaSecurity(fs)
	bucket := bind(fs, settings.LeaseBucket)
	function := fs.String("function", "", "the function whose cursor moves (required)")
	topic := fs.String("topic", "", "the source topic (required)")
	var partition, from, to optionalInt
	fs.Var(&partition, "partition", "the `number` of the partition (default: every partition of the topic that has a cursor for the function)")
	fs.Var(&from, "from-offset", "resume at this `offset` (this or --from-time is required)")
	fromTime := addTimeFlag(fs, "from-time", "resume in each partition at the first record whose timestamp is at or after this time (Kafka's offsets-for-times); a partition whose cursor is there already is left alone")
	fs.Var(&to, "to-offset", "end of the re-executed range, an `offset`, exclusive (default: the high-water mark); the handled records from it on are skipped, not applied again")
	reexecute := fs.Bool("reexecute", false, "apply already handled records again (audited; needs --reason)")
	reason := fs.String("reason", "", "why, for the audit log")
	keepIDs := fs.Bool("keep-event-ids", false, "with --reexecute: the re-executed records emit their original event ids, so downstream drops what it handled (default: new ids, downstream applies them again)")
	dryRun := fs.Bool("dry-run", false, "print what the replay would do per partition and change nothing")
	wait := fs.Bool("wait", false, "wait until the workers' cursors reach the end of what was replayed (a progress line on a terminal)")
	waitTimeout := fs.Duration("wait-timeout", 0, "with --wait: give up after this long (default: wait until Ctrl-C)")
	asJSON := fs.Bool("json", false, "print the plan (--dry-run) or the plan and what changed as one JSON object, for scripts (see docs/cli-json.md)")
	if err := parse(fs, args); err != nil {
		return err
	}
	dbURL, dbErr := databases.of(*function)
	for _, err := range []error{dbErr, requiredSetting(settings.NATSURL, *natsURL)} {
		if err != nil {
			return err
		}
	}
	for name, v := range map[string]string{"function": *function, "topic": *topic} {
		if err := required(name, v); err != nil {
			return err
		}
	}
	spec := operator.ReplaySpec{
		Function: *function, Topic: *topic, From: from.n, LeaseBucket: *bucket, KafkaBrokers: *brokers, KafkaSecurity: *sec, DryRun: *dryRun,
		ReplayOptions: inbox.ReplayOptions{Reexecute: *reexecute, KeepEventIDs: *keepIDs, Reason: *reason, Actor: actor("replay")},
	}
	if partition.set {
		if partition.n < 0 || partition.n > math.MaxInt32 {
			return &usageError{msg: "--partition must be 0 or more (leave it out for every partition)"}
		}
		spec.Partitions = []int32{int32(partition.n)}
	}
	switch {
	case !fromTime.IsZero() && from.set:
		return &usageError{msg: "--from-offset and --from-time exclude each other"}
	case !fromTime.IsZero():
		spec.FromTime = *fromTime
	case !from.set:
		return &usageError{msg: "--from-offset is required (0 or more), or --from-time"}
	case from.n < 0:
		return &usageError{msg: "--from-offset must be 0 or more"}
	}
	if to.set {
		if to.n < 0 {
			return &usageError{msg: "--to-offset must be 0 or more"}
		}
		if to.n == 0 {
			return &usageError{msg: "--to-offset 0 leaves nothing to replay: it is exclusive"}
		}
		spec.To = to.n
	}
	if *reexecute && *reason == "" {
		return &usageError{msg: "--reexecute applies records a second time; say why with --reason"}
	}
	if *keepIDs && !*reexecute {
		return &usageError{msg: "--keep-event-ids is a choice of a re-execution (--reexecute): an idempotent replay emits no events"}
	}
	if *waitTimeout != 0 && !*wait {
		return &usageError{msg: "--wait-timeout needs --wait"}
	}
	if *wait && *dryRun {
		return &usageError{msg: "--wait has nothing to wait for in a --dry-run"}
	}
	if len(*brokers) == 0 {
		return &usageError{msg: fmt.Sprintf("--%s is required (or set %s): the replay is checked against Kafka", settings.KafkaBrokers.Flag, settings.KafkaBrokers.Env)}
	}
	pool, err := connectPostgres(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	js, closeNATS, err := connectJetStream(*natsURL, "kfn replay", natsSec)
	if err != nil {
		return err
	}
	defer closeNATS()
	replays, err := operator.ReplayPartitions(ctx, pool, js, spec)
	if *asJSON {
		return printReplayJSON(ctx, stdout, pool, spec, replays, err, *wait, *waitTimeout)
	}
	if *dryRun && err == nil {
		printReplayPlans(stdout, spec, replays)
		return nil
	}
	for _, pr := range replays {
		printReplayResult(stdout, spec, pr)
	}
	if err != nil {
		return err
	}
	if *wait {
		return waitForReplay(ctx, stdout, pool, spec, replays, *waitTimeout)
	}
	return nil
}

// printReplayJSON prints the replay (or its plan) as one JSON object once
// it is done, and with wait once the workers reached its end; a replay
// that failed part way prints what it changed, then returns its error.
func printReplayJSON(ctx context.Context, stdout io.Writer, pool *pgxpool.Pool, spec operator.ReplaySpec, replays []operator.PartitionReplay, err error, wait bool, timeout time.Duration) error {
	if err != nil && len(replays) == 0 {
		return err
	}
	out := replayJSONOf(spec, replays)
	if err == nil && wait {
		began := time.Now()
		if err = waitForReplay(ctx, io.Discard, pool, spec, replays, timeout); err == nil {
			n := 0
			for _, pr := range replays {
				if pr.Result != nil {
					n++
				}
			}
			out.Waited = &replayWaitJSON{Partitions: n, After: time.Since(began).Round(100 * time.Millisecond).String()}
		}
	}
	if werr := writeJSON(stdout, out); werr != nil {
		return werr
	}
	return err
}

// optionalInt is an integer flag that knows whether it was given, and
// shows no default in -h.
type optionalInt struct {
	n   int64
	set bool
}

func (o *optionalInt) String() string {
	if o == nil || !o.set {
		return ""
	}
	return strconv.FormatInt(o.n, 10)
}

func (o *optionalInt) Set(s string) error {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return errors.New("not an integer")
	}
	o.n, o.set = n, true
	return nil
}

// printReplayResult prints what a replay did to one partition.
func printReplayResult(w io.Writer, spec operator.ReplaySpec, pr operator.PartitionReplay) {
	p := pr.Plan.Partition
	if pr.Nothing != "" {
		fmt.Fprintf(w, "%s: left alone: %s\n", p, pr.Nothing)
		return
	}
	res := pr.Result
	mode := "idempotent: records already handled will be skipped"
	if spec.Reexecute {
		ids := fmt.Sprintf("their events get new ids (generation %d)", res.Now.Generation)
		if !pr.Plan.NewEventIDs() {
			ids = fmt.Sprintf("their events keep their original ids (generation %d)", res.Now.Generation)
		}
		mode = fmt.Sprintf("re-execution: %d inbox rows released, records [%d, %d) will be applied again, %s", res.InboxReleased, pr.Plan.From, pr.Plan.To, ids)
		if pr.Plan.Skipped > 0 {
			mode += fmt.Sprintf("; [%d, %d) stays handled", pr.Plan.To, res.Previous.HighWater)
			if res.InboxRestored > 0 {
				mode += fmt.Sprintf(" (%d purged inbox rows written back)", res.InboxRestored)
			}
		}
	}
	fmt.Fprintf(w, "%s: cursor %d -> %d%s (%s); a worker resumes there within a few seconds\n",
		p, res.Previous.NextOffset, res.Now.NextOffset, fromTimeNote(spec, pr), mode)
}

// fromTimeNote says which offset --from-time resolved to.
func fromTimeNote(spec operator.ReplaySpec, pr operator.PartitionReplay) string {
	if spec.FromTime.IsZero() {
		return ""
	}
	if pr.TimeOffset < 0 {
		return fmt.Sprintf(" [--from-time %s: no record that recent, the high watermark]", spec.FromTime.Format(time.RFC3339))
	}
	return fmt.Sprintf(" [--from-time %s: first record at or after it]", spec.FromTime.Format(time.RFC3339))
}

// printReplayPlans prints a dry run: per partition, the range, what of it
// was handled, what would be re-executed and what downstream would see.
func printReplayPlans(w io.Writer, spec operator.ReplaySpec, replays []operator.PartitionReplay) {
	mode := "an idempotent replay"
	if spec.Reexecute {
		mode = "a re-execution"
	}
	fmt.Fprintf(w, "dry run of %s: nothing was changed (no lease taken, no epoch moved, nothing written)\n", mode)
	for _, pr := range replays {
		plan := pr.Plan
		if pr.Nothing != "" {
			fmt.Fprintf(w, "%s: nothing to replay: %s\n", plan.Partition, pr.Nothing)
			continue
		}
		fmt.Fprintf(w, "%s: cursor %d -> %d%s\n", plan.Partition, plan.Cursor.NextOffset, plan.From, fromTimeNote(spec, pr))
		kafka := ""
		if pr.KafkaFirst >= 0 && plan.KafkaHolds < plan.Offsets {
			kafka = fmt.Sprintf(", %d of them still in Kafka (it holds %d..%d)", plan.KafkaHolds, pr.KafkaFirst, pr.KafkaHigh-1)
		}
		fmt.Fprintf(w, "  range:           [%d, %d): %d offsets%s\n", plan.From, plan.To, plan.Offsets, kafka)
		fmt.Fprintf(w, "  already handled: %d (below the high-water mark %d); inbox rows: %d applied, %d dead-lettered\n",
			plan.Handled, plan.Cursor.HighWater, plan.InboxApplied, plan.InboxDeadLettered)
		if !spec.Reexecute {
			fmt.Fprintf(w, "  to re-execute:   0: the records are read again and skipped\n")
			continue
		}
		fmt.Fprintf(w, "  to re-execute:   %d: inbox rows of [%d, %d) released, the high-water mark drops to %d\n", plan.Reexecute, plan.From, plan.To, plan.From)
		if plan.Skipped > 0 {
			restore := ""
			if plan.InboxRestore > 0 {
				restore = fmt.Sprintf(" (%d inbox rows purged by retention would be written back)", plan.InboxRestore)
			}
			fmt.Fprintf(w, "  stays handled:   %d: [%d, %d) keep their inbox rows and are skipped%s\n", plan.Skipped, plan.To, plan.Cursor.HighWater, restore)
		}
		if plan.NewEventIDs() {
			fmt.Fprintf(w, "  downstream:      the re-executed records emit events with NEW ids (generation %d -> %d): downstream functions apply them again; --keep-event-ids keeps the original ids\n",
				plan.Generation, plan.NewGeneration)
		} else {
			fmt.Fprintf(w, "  downstream:      the re-executed records emit their ORIGINAL event ids (generation %d kept): JetStream's duplicate window and the downstream inboxes drop the events they already handled\n",
				plan.Generation)
		}
	}
}

// waitForReplay polls the replayed partitions' cursors until each reaches
// its target (operator.PartitionReplay.ReplayTarget), printing a progress
// line (cursor -> target, rate, ETA) while stdout is a terminal.
func waitForReplay(ctx context.Context, stdout io.Writer, pool *pgxpool.Pool, spec operator.ReplaySpec, replays []operator.PartitionReplay, timeout time.Duration) error {
	targets := map[int32]int64{}
	start := map[int32]int64{}
	var parts []int32
	for _, pr := range replays {
		if pr.Result == nil {
			continue
		}
		p := pr.Plan.Partition.Partition
		parts = append(parts, p)
		targets[p], start[p] = pr.ReplayTarget(), pr.Result.Now.NextOffset
	}
	if len(parts) == 0 {
		return nil
	}
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	tty := isTerminal(stdout)
	began := time.Now()
	var total int64
	for _, p := range parts {
		total += max(0, targets[p]-start[p])
	}
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		at, err := operator.CursorPositions(ctx, pool, spec.Function, spec.Topic, parts)
		if err != nil && ctx.Err() == nil {
			return err
		}
		var done, remaining int64
		finished := 0
		for _, p := range parts {
			cur := at[p]
			if cur >= targets[p] {
				finished++
			}
			done += max(0, min(cur, targets[p])-start[p])
			remaining += max(0, targets[p]-cur)
		}
		if err == nil && finished == len(parts) {
			if tty {
				fmt.Fprint(stdout, "\r\033[K")
			}
			fmt.Fprintf(stdout, "%s/%s: the workers reached the end of the replay in %d partition(s) after %s\n",
				spec.Function, spec.Topic, len(parts), time.Since(began).Round(100*time.Millisecond))
			return nil
		}
		if tty {
			fmt.Fprint(stdout, "\r\033[K"+progressLine(parts, at, targets, done, total, remaining, time.Since(began)))
		}
		select {
		case <-ctx.Done():
			if tty {
				fmt.Fprintln(stdout)
			}
			return fmt.Errorf("stopped waiting with %d records to go (the replay itself is done; the workers go on): %w", remaining, ctx.Err())
		case <-tick.C:
		}
	}
}

// progressLine is one line of a replay's progress: the cursor and its
// target (of the single partition, or how many partitions are done), the
// rate so far and the time left at that rate.
func progressLine(parts []int32, at, targets map[int32]int64, done, total, remaining int64, elapsed time.Duration) string {
	var where string
	if len(parts) == 1 {
		where = fmt.Sprintf("cursor %d -> %d", at[parts[0]], targets[parts[0]])
	} else {
		n := 0
		for _, p := range parts {
			if at[p] >= targets[p] {
				n++
			}
		}
		where = fmt.Sprintf("%d/%d partitions done", n, len(parts))
	}
	rate := float64(done) / max(elapsed.Seconds(), 0.001)
	eta := "?"
	if rate > 0 {
		eta = time.Duration(float64(remaining) / rate * float64(time.Second)).Round(time.Second).String()
	}
	return fmt.Sprintf("%s, %d/%d records, %.0f records/s, ETA %s", where, done, total, rate, eta)
}

// isTerminal reports whether w is a terminal (a character device).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// actor names who ran a kfn command, for the audit log.
func actor(command string) string {
	name := "unknown"
	if u, err := user.Current(); err == nil {
		name = u.Username
	}
	host, _ := os.Hostname()
	return fmt.Sprintf("kfn-%s:%s@%s", command, name, host)
}

// bindNATSSecurity binds the NATS credential and TLS flags; the value is
// theirs once the flags are parsed.
func bindNATSSecurity(fs *flagSet) *runtime.NATSSecurity {
	var sec runtime.NATSSecurity
	connect.BindNATSSecurity(fs.settings, &sec)
	return &sec
}

// connectJetStream connects to NATS and returns its JetStream API and a
// function that closes the connection.
func connectJetStream(url, name string, sec ...*runtime.NATSSecurity) (jetstream.JetStream, func(), error) {
	var s runtime.NATSSecurity
	if len(sec) > 0 {
		s = *sec[0]
	}
	nc, js, err := connect.NATSWith(url, name, s)
	var bad *connect.SettingError
	if errors.As(err, &bad) {
		return nil, nil, &usageError{msg: err.Error()}
	}
	if err != nil {
		return nil, nil, err
	}
	return js, nc.Close, nil
}
