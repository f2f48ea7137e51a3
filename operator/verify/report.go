package verify

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// Report is what Run found. Its JSON is the output of kfn verify --json.
type Report struct {
	Function   string     `json:"function"`
	Source     string     `json:"source"`
	Cut        Cut        `json:"cut"`
	Checked    Checked    `json:"checked"`
	OK         bool       `json:"ok"`
	Violations Violations `json:"violations"`
	Seconds    float64    `json:"seconds"`
}

// Checked counts what was compared: the records below the cut, the
// function's events in the stream up to the cut and the effects the
// effects query returned (rows, or the sum of its counts).
type Checked struct {
	Records int64 `json:"records"`
	Events  int64 `json:"events"`
	Effects int64 `json:"effects"`
}

// Cut states what the run read: below what, from where.
type Cut struct {
	Statement string     `json:"statement"`
	Snapshot  string     `json:"postgres_snapshot"`
	Stream    *StreamCut `json:"stream,omitempty"`
	Effects   string     `json:"effects"`
	// Range is the range asked for (kfn verify --partitions, --from,
	// --to); nil: the whole source. Partitions then holds the range's
	// partitions only.
	Range      *RangeCut      `json:"range,omitempty"`
	Partitions []PartitionCut `json:"partitions"`
	Notes      []string       `json:"notes,omitempty"`
}

// RangeCut is the range a run was restricted to, as asked: its
// partitions, and its bounds (an offset or an RFC 3339 time; empty: none).
// Each partition's checked offsets are in its PartitionCut.
type RangeCut struct {
	Partitions []int32 `json:"partitions"`
	From       string  `json:"from,omitempty"`
	To         string  `json:"to,omitempty"`
}

// String writes the range as "partitions 0,3 from 100 to 200".
func (r *RangeCut) String() string {
	s := "partitions " + partitionList(r.Partitions)
	if r.From != "" {
		s += " from " + r.From
	}
	if r.To != "" {
		s += " to " + r.To
	}
	return s
}

// StreamCut is the event stream's part of the cut.
type StreamCut struct {
	Name    string `json:"name"`
	LastSeq uint64 `json:"last_seq"`
}

// PartitionCut is one partition's part of the cut: Kafka's range, the
// cursor, and what was checked and what is pending.
type PartitionCut struct {
	Partition  int32 `json:"partition"`
	KafkaFirst int64 `json:"kafka_first"`
	KafkaHigh  int64 `json:"kafka_high"`
	// Cursor is the cursor's next_offset, HighWater its high-water mark;
	// both -1 when the function has no cursor there yet.
	Cursor    int64 `json:"cursor"`
	HighWater int64 `json:"high_water"`
	// The offsets [CheckedFrom, CheckedBelow) were compared: from Kafka's
	// first offset (or the range's start) to the cursor (or the range's
	// end).
	CheckedFrom  int64 `json:"checked_from"`
	CheckedBelow int64 `json:"checked_below"`
	// Pending counts the records from the cursor to the high watermark
	// (or the range's end).
	Pending int64 `json:"pending"`
}

// Violations holds the six kinds; each is present, with count 0 when clean.
type Violations struct {
	Lost               Violation `json:"lost"`
	Duplicated         Violation `json:"duplicated"`
	Unexpected         Violation `json:"unexpected"`
	FencedButCommitted Violation `json:"fenced_but_committed"`
	Unpublished        Violation `json:"unpublished"`
	OutOfOrder         Violation `json:"out_of_order"`
}

// Violation is the count of one kind and a few examples.
type Violation struct {
	Count    int64    `json:"count"`
	Examples []string `json:"examples"`
	max      int
}

// add counts one violation and keeps its example while there is room.
func (v *Violation) add(format string, args ...any) { v.addN(1, format, args...) }

func (v *Violation) addN(n int64, format string, args ...any) {
	v.Count += n
	if len(v.Examples) < v.max {
		v.Examples = append(v.Examples, fmt.Sprintf(format, args...))
	}
}

func (vs *Violations) init(examples int) {
	for _, v := range vs.all() {
		v.max, v.Examples = examples, []string{}
	}
}

func (vs *Violations) all() []*Violation {
	return []*Violation{&vs.Lost, &vs.Duplicated, &vs.Unexpected, &vs.FencedButCommitted, &vs.Unpublished, &vs.OutOfOrder}
}

// kinds names the violations in the order of all().
var kinds = []string{"lost", "duplicated", "unexpected", "fenced_but_committed", "unpublished", "out_of_order"}

// Total is the number of violations of every kind.
func (vs *Violations) Total() int64 {
	var n int64
	for _, v := range vs.all() {
		n += v.Count
	}
	return n
}

// WriteTable prints the report for a person: the cut, what was checked,
// one line per kind of violation with its examples, and the verdict.
func (r *Report) WriteTable(w io.Writer) error {
	fmt.Fprintf(w, "kfn verify: function %s, source %s\n", r.Function, r.Source)
	fmt.Fprintf(w, "cut: %s\n", r.Cut.Statement)
	fmt.Fprintf(w, "  postgres: %s\n", r.Cut.Snapshot)
	if r.Cut.Stream != nil {
		fmt.Fprintf(w, "  stream:   %s up to sequence %d\n", r.Cut.Stream.Name, r.Cut.Stream.LastSeq)
	} else {
		fmt.Fprintln(w, "  stream:   not read (no --nats-url): events unchecked")
	}
	fmt.Fprintf(w, "  effects:  %s\n", r.Cut.Effects)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	if r.Cut.Range != nil {
		fmt.Fprintf(w, "  range:    %s (only these records are checked)\n", r.Cut.Range)
	}
	fmt.Fprintln(tw, "  PARTITION\tKAFKA FIRST\tKAFKA HIGH\tCURSOR\tHIGH WATER\tCHECKED FROM\tCHECKED BELOW\tPENDING")
	for _, p := range r.Cut.Partitions {
		fmt.Fprintf(tw, "  %d\t%d\t%d\t%s\t%s\t%d\t%d\t%d\n", p.Partition, p.KafkaFirst, p.KafkaHigh, orNone(p.Cursor), orNone(p.HighWater), p.CheckedFrom, p.CheckedBelow, p.Pending)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, n := range r.Cut.Notes {
		fmt.Fprintf(w, "  note: %s\n", n)
	}
	fmt.Fprintf(w, "checked: %d records, %d events, %d effects in %.2fs\n", r.Checked.Records, r.Checked.Events, r.Checked.Effects, r.Seconds)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VIOLATION\tCOUNT\tEXAMPLES")
	for i, v := range r.Violations.all() {
		fmt.Fprintf(tw, "%s\t%d\t%s\n", kinds[i], v.Count, strings.Join(v.Examples, "; "))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if r.OK {
		_, err := fmt.Fprintln(w, "OK: no violation")
		return err
	}
	_, err := fmt.Fprintf(w, "FAILED: %d violations\n", r.Violations.Total())
	return err
}

func orNone(n int64) string {
	if n < 0 {
		return "-"
	}
	return fmt.Sprint(n)
}

// done ends the report: its verdict and how long the run took.
func (r *Report) done(start time.Time) *Report {
	r.OK = r.Violations.Total() == 0
	r.Seconds = time.Since(start).Seconds()
	return r
}

// room reports whether another example would be kept.
func (v *Violation) room() bool { return len(v.Examples) < v.max }
