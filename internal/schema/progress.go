package schema

import (
	"fmt"
	"io"
	"sync"
	"time"
)

// Progress is a step of Migrate that happens outside a migration's
// transaction, while workers built for the older schema keep running: the
// online copy of kfn.inbox ahead of migration 0012_compact_inbox, and the
// swap that ends it (compact_inbox.go). Its String is the line kfn migrate
// prints.
type Progress struct {
	Migration string // the migration it prepares, such as 0012_compact_inbox
	Step      Step
	// Rows copied so far, Resumed of them by an earlier run that was
	// interrupted; Estimate is about how many rows the old table holds
	// (Postgres' statistics; 0 when it has none).
	Rows, Resumed, Estimate int64
	// Elapsed is the time since this run's copy started; for StepSwapped,
	// the swap's transaction.
	Elapsed time.Duration
	// Attempt counts, for StepWaiting, the attempts that gave up waiting.
	Attempt int
}

// Step is what a Progress reports.
type Step int

const (
	// StepMirroring: the new table exists, and a trigger mirrors every
	// write of the old one into it; the copy of the old rows starts.
	StepMirroring Step = iota + 1
	// StepCopying: a batch of old rows was copied.
	StepCopying
	// StepCopied: every old row is copied.
	StepCopied
	// StepWaiting: another transaction held the old table for longer than
	// the migrator waits at a time; it tries again.
	StepWaiting
	// StepSwapping: the migration's transaction starts. Workers built for
	// the older schema stand still from here, and then fail.
	StepSwapping
	// StepSwapped: the migration committed.
	StepSwapped
)

func (p Progress) String() string {
	online := "migration " + p.Migration + ", online: "
	switch p.Step {
	case StepMirroring:
		return online + "copying kfn.inbox into kfn.inbox_compact while workers keep running (a trigger mirrors their writes)"
	case StepCopying:
		of := ""
		if p.Estimate > p.Rows {
			of = fmt.Sprintf(" of about %d", p.Estimate)
		}
		return fmt.Sprintf("%scopied %d%s rows of kfn.inbox (%s)", online, p.Rows, of, p.rate())
	case StepCopied:
		if p.Resumed > 0 && p.Rows == p.Resumed {
			return fmt.Sprintf("%sthe copy of kfn.inbox finished in an earlier run (%d rows)", online, p.Rows)
		}
		resumed := ""
		if p.Resumed > 0 {
			resumed = fmt.Sprintf(", %d of them by an earlier run", p.Resumed)
		}
		return fmt.Sprintf("%scopied %d rows of kfn.inbox%s in %s (%s)", online, p.Rows, resumed, p.Elapsed.Round(time.Millisecond), p.rate())
	case StepWaiting:
		return fmt.Sprintf("%sanother transaction holds kfn.inbox: waiting again (attempt %d)", online, p.Attempt+1)
	case StepSwapping:
		return "migration " + p.Migration + ": swapping kfn.inbox for its copy: workers built for an older schema stop here"
	case StepSwapped:
		return fmt.Sprintf("migration %s: swapped in %s", p.Migration, p.Elapsed.Round(time.Millisecond))
	}
	return fmt.Sprintf("migration %s: step %d", p.Migration, p.Step)
}

// rate is this run's copy rate.
func (p Progress) rate() string {
	if p.Elapsed <= 0 {
		return "0 rows/s"
	}
	return fmt.Sprintf("%.0f rows/s", float64(p.Rows-p.Resumed)/p.Elapsed.Seconds())
}

// printEvery is how often PrintProgress prints the copy's progress.
const printEvery = 2 * time.Second

// PrintProgress returns a Progress receiver for MigrateReporting that
// writes each step's String as a line to w, after prefix, and the copy's
// progress (StepCopying) every few seconds.
func PrintProgress(w io.Writer, prefix string) func(Progress) {
	var mu sync.Mutex
	var last time.Time
	return func(p Progress) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case p.Step == StepMirroring:
			last = time.Now()
		case p.Step == StepCopying && time.Since(last) < printEvery:
			return
		case p.Step == StepCopying:
			last = time.Now()
		}
		fmt.Fprintln(w, prefix+p.String())
	}
}
