package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/operator"
)

// runDLQRetry marks dead letters for retry; the workers apply them.
func runDLQRetry(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("dlq retry", help{
		usage: []string{`kfn dlq retry (--function F [--topic T] [--partition P] [--dead-reason R] | --id N[,N…]) --reason "…" [flags]`},
		text: `
Runs dead-lettered records through their function again, exactly once. This
command runs no handler: it marks the dead letters for retry (audited, in one
transaction) and the worker that owns each record's partition (or subject)
applies them, in offset order, under its own fence, within a few seconds. A
letter that applies is deleted in the same transaction, so retrying it again
applies nothing; its events get the ids a first apply would have had. A retry
that fails again keeps the letter (its attempts grow, the new error is kept)
and the partition goes on. An oversized record, or one parked without its
bytes, cannot be retried from its dead letter: re-read it from Kafka with
kfn replay instead. For a function with KeyOrder ParkKey, a letter that
parked its key releases it when it applies: the key's key_parked letters
are then retried in offset order, with no command; a key_parked letter still
parked behind an earlier letter is refused. Without --wait it exits 1 when a
letter was refused.`,
		examples: `
# the one dead letter whose bug was fixed in v2, waiting for the outcome
kfn dlq retry --id 1187 --reason "INC-42: decoder fixed in v2" --wait

# every letter of orders on partition 3 that failed in the handler
kfn dlq retry --function orders --topic orders --partition 3 --dead-reason handler_error \
    --reason "INC-42: the price service is back" --wait --json`,
	}, stderr)
	databases := bindDatabases(fs)
	function := fs.String("function", "", "retry the dead letters of this function (required unless --id is given; with --id, it picks the function's database)")
	topic := fs.String("topic", "", "only those of this topic (or subject)")
	partition := fs.Int("partition", -1, "only those of this partition (-1: every partition)")
	deadReason := fs.String("dead-reason", "", "only those dead-lettered with this reason (handler_error, permanent, panic, timeout, data_error, parked, key_parked)")
	var ids idList
	fs.Var(&ids, "id", "retry the dead letter with this id (kfn dlq lists them); repeat it or give a comma-separated list")
	limit := fs.Int("limit", 1000, "at most this many dead letters")
	reason := fs.String("reason", "", "why, for the audit log (required)")
	actorName := fs.String("actor", "", "who asks, for the audit log (default: kfn-dlq-retry:<OS user>@<host>)")
	wait := fs.Bool("wait", false, "wait until every marked dead letter is applied or has failed again, and report each; exit 1 unless all were applied")
	timeout := fs.Duration("timeout", 2*time.Minute, "with --wait: how long to wait")
	asJSON := fs.Bool("json", false, "print JSON for scripts")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := required("reason", *reason); err != nil {
		return err
	}
	switch {
	case *function == "" && len(ids) == 0:
		return &usageError{msg: "say which dead letters to retry: --function (with --topic, --partition, --dead-reason to narrow it) or --id"}
	case *partition < -1:
		return &usageError{msg: "--partition must be 0 or more"}
	case *limit < 1:
		return &usageError{msg: "--limit must be at least 1"}
	case *timeout <= 0:
		return &usageError{msg: "--timeout must be positive"}
	}
	if *deadReason != "" && !slices.Contains(deadLetterReasons, *deadReason) {
		return &usageError{msg: fmt.Sprintf("--dead-reason %q is not a dead letter reason: use one of %s", *deadReason, strings.Join(deadLetterReasons, ", "))}
	}
	who := *actorName
	if who == "" {
		who = actor("dlq-retry")
	}
	pool, err := databases.open(ctx, *function)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := checkSelection(ctx, pool, *function, *topic, int32(*partition)); err != nil {
		return err
	}
	marks, err := operator.Retry(ctx, pool, operator.RetryRequest{
		Function: *function, Topic: *topic, Partition: int32(*partition), DeadReason: *deadReason, IDs: ids, Limit: *limit,
		Reason: *reason, Actor: who,
	})
	if err != nil {
		return err
	}
	report := retryReport{RequestedAt: marks.RequestedAt, Actor: who, Marked: marks.Marked, Refused: marks.Refused}
	if report.Marked == nil {
		report.Marked = []inbox.RetryMark{}
	}
	if report.Refused == nil {
		report.Refused = []inbox.RetryMark{}
	}
	var waitErr error
	if *wait && len(marks.Marked) > 0 {
		if !*asJSON {
			fmt.Fprintf(stderr, "marked %d dead letters for retry; waiting for the workers (up to %s)…\n", len(marks.Marked), *timeout)
		}
		var outcomes []inbox.RetryOutcome
		outcomes, waitErr = operator.WaitRetries(ctx, pool, marks, *timeout, 200*time.Millisecond)
		for i, o := range outcomes {
			m := marks.Marked[i]
			report.Outcomes = append(report.Outcomes, retryOutcome{ID: m.ID, Partition: m.Partition, Offset: m.Offset, DeadReason: m.DeadReason,
				Outcome: o.Outcome, Error: o.Error, By: o.By, At: o.At})
		}
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(report); err != nil {
			return err
		}
	} else if err := report.print(stdout, *wait); err != nil {
		return err
	}
	if waitErr != nil {
		return waitErr
	}
	return report.verdict(*wait, *function, len(ids) > 0)
}

// retryReport is what kfn dlq retry prints (--json: as is).
type retryReport struct {
	RequestedAt time.Time         `json:"requested_at"`
	Actor       string            `json:"actor"`
	Marked      []inbox.RetryMark `json:"marked"`
	Refused     []inbox.RetryMark `json:"refused"`
	Outcomes    []retryOutcome    `json:"outcomes,omitempty"` // with --wait
}

// retryOutcome is a marked letter and how its retry ended.
type retryOutcome struct {
	ID         int64           `json:"id"`
	Partition  inbox.Partition `json:"partition"`
	Offset     int64           `json:"offset"`
	DeadReason string          `json:"dead_reason"`
	Outcome    string          `json:"outcome"` // applied, failed, pending or gone
	Error      string          `json:"error,omitempty"`
	By         string          `json:"by,omitempty"` // the worker that applied it or failed it
	At         time.Time       `json:"at,omitzero"`
}

func (r retryReport) print(w io.Writer, waited bool) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	switch {
	case len(r.Marked) == 0:
		fmt.Fprintln(tw, "no dead letter was marked for retry")
	case waited:
		fmt.Fprintln(tw, "ID\tFUNCTION\tTOPIC\tPARTITION\tOFFSET\tDEAD REASON\tOUTCOME\tERROR")
		for _, o := range r.Outcomes {
			firstLine, _, _ := strings.Cut(o.Error, "\n")
			fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%d\t%s\t%s\t%s\n", o.ID, o.Partition.Consumer, o.Partition.Topic, o.Partition.Partition,
				o.Offset, o.DeadReason, o.Outcome, firstLine)
		}
	default:
		fmt.Fprintf(tw, "marked %d dead letters for retry; the workers that own their partitions apply them within a few seconds (--wait waits for them):\n", len(r.Marked))
		fmt.Fprintln(tw, "ID\tFUNCTION\tTOPIC\tPARTITION\tOFFSET\tDEAD REASON\tATTEMPTS")
		for _, m := range r.Marked {
			fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%d\t%s\t%d\n", m.ID, m.Partition.Consumer, m.Partition.Topic, m.Partition.Partition, m.Offset, m.DeadReason, m.Attempts)
		}
	}
	for _, m := range r.Refused {
		if m.Partition.Consumer == "" {
			fmt.Fprintf(tw, "refused %d: %s\n", m.ID, m.Refused)
			continue
		}
		fmt.Fprintf(tw, "refused %d (%s@%d): %s\n", m.ID, m.Partition, m.Offset, m.Refused)
	}
	if waited && len(r.Outcomes) > 0 {
		counts := map[string]int{}
		for _, o := range r.Outcomes {
			counts[o.Outcome]++
		}
		fmt.Fprintf(tw, "applied %d, failed again %d, still pending %d, gone %d, refused %d\n", counts[inbox.RetryApplied],
			counts[inbox.RetryFailedAgain], counts[inbox.RetryPending], counts[inbox.RetryGone], len(r.Refused))
	}
	return tw.Flush()
}

// verdict is the exit status: an error (exit 1) unless every selected
// letter was marked (and, with --wait, applied).
func (r retryReport) verdict(waited bool, function string, byID bool) error {
	if len(r.Marked) == 0 && len(r.Refused) == 0 {
		what := "function " + function
		if byID {
			what = "the given ids"
		}
		return fmt.Errorf("no dead letter of %s matches", what)
	}
	var problems []string
	if len(r.Refused) > 0 {
		problems = append(problems, fmt.Sprintf("%d refused", len(r.Refused)))
	}
	if waited {
		notApplied := 0
		for _, o := range r.Outcomes {
			if o.Outcome != inbox.RetryApplied {
				notApplied++
			}
		}
		if notApplied > 0 {
			problems = append(problems, fmt.Sprintf("%d of %d marked not applied", notApplied, len(r.Outcomes)))
		}
	}
	if len(problems) > 0 {
		return errors.New("retry: " + strings.Join(problems, ", "))
	}
	return nil
}

// idList is a flag of dead letter ids: repeated, or comma-separated.
type idList []int64

func (l *idList) String() string {
	if l == nil {
		return ""
	}
	s := make([]string, len(*l))
	for i, id := range *l {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ",")
}

func (l *idList) Set(v string) error {
	for _, f := range strings.Split(v, ",") {
		id, err := strconv.ParseInt(strings.TrimSpace(f), 10, 64)
		if err != nil || id < 1 {
			return fmt.Errorf("%q is not a dead letter id", f)
		}
		*l = append(*l, id)
	}
	return nil
}
