package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/operator"
)

// dlqCommands are the subcommands of kfn dlq; kfn dlq alone is kfn dlq list.
var dlqCommands = map[string]command{
	"list":    {"list dead letters, oldest first (kfn dlq alone does)", runDLQList},
	"show":    {"print one dead letter whole: error, key, value, headers", runDLQShow},
	"discard": {"delete dead letters for good, audited", runDLQDiscard},
	"purge":   {"delete the dead letters older than a duration, audited", runDLQPurge},
	"park":    {"dead-letter one stuck record by hand", runDLQPark},
	"retry":   {"run dead letters through their function again, once", runDLQRetry},
}

func runDLQ(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		sub, ok := dlqCommands[args[0]]
		if !ok {
			return &usageError{msg: fmt.Sprintf("unknown dlq command %q: use list, show, discard, purge, park or retry", args[0])}
		}
		return inCommand("dlq "+args[0], sub.run(ctx, args[1:], stdout, stderr))
	}
	return listDeadLetters(ctx, args, help{
		usage: []string{
			"kfn dlq [list] [flags]",
			"kfn dlq show ID [flags]",
			`kfn dlq discard ID… | filters --reason "…" [--dry-run]`,
			"kfn dlq purge --older-than DURATION [--dry-run]",
			"kfn dlq park [flags]",
			"kfn dlq retry [flags]",
		},
		text: `
Lists and handles dead letters: the records a function could not apply,
with their errors. kfn dlq alone is kfn dlq list, whose flags are below;
run kfn dlq <command> -h for a command's flags.`,
		commands: dlqCommands,
		examples: dlqListHelp.examples,
	}, stdout, stderr)
}

// deadLetterReasons are the reasons kfn dead-letters a record with.
var deadLetterReasons = []string{"handler_error", "permanent", "panic", "timeout", "oversized", "data_error", "parked", "key_parked"}

// filterFlags are the flags that select dead letters, shared by kfn dlq
// list and kfn dlq discard.
type filterFlags struct {
	function, topic, deadReason, errorText *string
	since, until                           *time.Time
	partition, limit                       *int
}

// addFilterFlags binds the filter flags to fs. reasonFlag is the name of
// the flag that selects by the dead letter's reason ("reason" for list;
// discard's --reason is the operator's, for the audit log).
func addFilterFlags(fs *flagSet, reasonFlag string, limit int, limitUsage string) *filterFlags {
	f := &filterFlags{
		function:   fs.String("function", "", "only this function (default: all)"),
		topic:      fs.String("topic", "", "only this source topic (default: all)"),
		partition:  fs.Int("partition", -1, "only this partition (-1: all)"),
		deadReason: fs.String(reasonFlag, "", "only dead letters with this reason: "+strings.Join(deadLetterReasons, ", ")),
		errorText:  fs.String("error", "", "only dead letters whose error text contains this (case-sensitive)"),
		since:      addTimeFlag(fs, "since", "only those dead-lettered at or after this time"),
		until:      addTimeFlag(fs, "until", "only those dead-lettered before this time"),
		limit:      fs.Int("limit", limit, limitUsage),
	}
	return f
}

// filter makes the filter of the parsed flags.
func (f *filterFlags) filter(reasonFlag string, now time.Time) (operator.DeadLetterFilter, error) {
	out := operator.DeadLetterFilter{
		Consumer: *f.function, Topic: *f.topic, Reason: *f.deadReason, ErrorContains: *f.errorText, Limit: *f.limit,
	}
	if *f.partition < -1 {
		return out, &usageError{msg: "--partition must be 0 or more"}
	}
	if *f.partition >= 0 {
		p := int32(*f.partition)
		out.Partition = &p
	}
	if *f.limit < 0 {
		return out, &usageError{msg: "--limit must not be negative"}
	}
	out.Since, out.Until = *f.since, *f.until
	if !out.Since.IsZero() && !out.Until.IsZero() && !out.Since.Before(out.Until) {
		return out, &usageError{msg: fmt.Sprintf("--since (%s) must be before --until (%s)", out.Since.Format(time.RFC3339), out.Until.Format(time.RFC3339))}
	}
	if out.Reason != "" && !slices.Contains(deadLetterReasons, out.Reason) {
		return out, &usageError{msg: fmt.Sprintf("--%s %q is not a dead letter reason: use one of %s", reasonFlag, out.Reason, strings.Join(deadLetterReasons, ", "))}
	}
	return out, nil
}

var dlqListHelp = help{
	usage: []string{"kfn dlq list [flags]"},
	text: `
Lists dead letters, oldest first. Key and headers are shown as text when
printable, as 0x-hex otherwise, cut to 40 bytes; --json has every byte
(base64) and the value. --reason selects by the dead letter's reason (kfn
dlq discard calls this filter --dead-reason: its --reason is yours, for the
audit log).`,
	examples: `
kfn dlq --function orders --since 2h
kfn dlq list --reason permanent --error "decode" --limit 20
kfn dlq list --topic orders --partition 3 --since 2026-03-01T00:00:00Z --until 2026-03-02T00:00:00Z --json`,
}

func runDLQList(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return listDeadLetters(ctx, args, dlqListHelp, stdout, stderr)
}

// listDeadLetters is kfn dlq list, whose -h prints h.
func listDeadLetters(ctx context.Context, args []string, h help, stdout, stderr io.Writer) error {
	fs := newFlags("dlq list", h, stderr)
	databases := bindDatabases(fs)
	filters := addFilterFlags(fs, "reason", 100, "at most this many dead letters")
	asJSON := fs.Bool("json", false, "print JSON (with every byte, base64) for scripts")
	if err := parse(fs, args); err != nil {
		return err
	}
	f, err := filters.filter("reason", time.Now())
	if err != nil {
		return err
	}
	if f.Limit < 1 {
		return &usageError{msg: "--limit must be at least 1"}
	}
	f.Limit++ // one more, to tell whether there are more
	var dead []inbox.DeadLetter
	var unknown error // a filter that no database knows
	known := 0
	err = databases.eachDatabase(ctx, f.Consumer, func(pool *pgxpool.Pool) error {
		if err := checkSelection(ctx, pool, f.Consumer, f.Topic, partitionOf(f.Partition)); err != nil {
			var ferr *operator.UnknownFilterError
			if errors.As(err, &ferr) {
				unknown = cmp.Or(unknown, err)
				return nil
			}
			return err
		}
		known++
		these, err := operator.ListDeadLetters(ctx, pool, f)
		dead = append(dead, these...)
		return err
	})
	if err == nil && known == 0 {
		err = unknown
	}
	if err != nil {
		return err
	}
	// From several databases: the oldest of them all.
	slices.SortStableFunc(dead, func(a, b inbox.DeadLetter) int { return a.DeadAt.Compare(b.DeadAt) })
	dead = dead[:min(len(dead), f.Limit)]
	more := len(dead) == f.Limit
	if more {
		dead = dead[:f.Limit-1]
		defer fmt.Fprintf(stderr, "kfn dlq list: only the oldest %d shown; more match: narrow the filters (--since) or raise --limit\n", len(dead))
	}
	if *asJSON {
		out := make([]deadLetterWhole, len(dead))
		for i, d := range dead {
			out[i] = wholeJSON(d)
		}
		return writeJSON(stdout, out)
	}
	return printDeadLetterTable(stdout, dead)
}

// printDeadLetterTable prints one line per dead letter: coordinates,
// reason, attempts, time, key, headers and the first line of the error.
func printDeadLetterTable(w io.Writer, dead []inbox.DeadLetter) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tFUNCTION\tTOPIC\tPARTITION\tOFFSET\tREASON\tATTEMPTS\tDEAD AT\tKEY\tHEADERS\tERROR")
	for _, d := range dead {
		firstLine, _, _ := strings.Cut(d.Error, "\n")
		headers := make([]string, 0, len(d.Headers))
		for i, h := range d.Headers {
			if i == maxShownHeaders {
				headers = append(headers, fmt.Sprintf("…(%d more)", len(d.Headers)-i))
				break
			}
			headers = append(headers, printable(h.Key)+"="+printable(h.Value))
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%d\t%s\t%d\t%s\t%s\t%s\t%s\n", d.ID, d.Partition.Consumer, d.Partition.Topic, d.Partition.Partition,
			d.Offset, d.Reason, d.Attempts, d.DeadAt.Format("2006-01-02 15:04:05"), printable(d.Key), strings.Join(headers, ","), safeText(firstLine))
	}
	return tw.Flush()
}

// deadLetterJSON is a dead letter in kfn's JSON output, without its value.
// Bytes are base64 (null for a null key or header value).
type deadLetterJSON struct {
	ID         int64          `json:"id"`
	Function   string         `json:"function"`
	Topic      string         `json:"topic"`
	Partition  int32          `json:"partition"`
	Offset     int64          `json:"offset"`
	Reason     string         `json:"reason"`
	Error      string         `json:"error"`
	Attempts   int            `json:"attempts"`
	DeadAt     time.Time      `json:"dead_at"`
	RecordTime *time.Time     `json:"record_time"` // null when unknown
	Key        []byte         `json:"key"`
	Headers    []inbox.Header `json:"headers"`
	ValueSize  int64          `json:"value_size"`
	StoredRaw  bool           `json:"stored_raw"` // the row was kept as one raw blob, decoded here
}

// deadLetterWhole is a dead letter in kfn's JSON output, with its value.
type deadLetterWhole struct {
	deadLetterJSON
	Value []byte `json:"value"`
	// ValueSHA256 (hex) is set when Value is only the first bytes of the
	// record's value (an oversized record): the SHA-256 of the whole value.
	ValueSHA256 string `json:"value_sha256,omitempty"`
}

func summaryJSON(d inbox.DeadLetter) deadLetterJSON {
	out := deadLetterJSON{
		ID: d.ID, Function: d.Partition.Consumer, Topic: d.Partition.Topic, Partition: d.Partition.Partition, Offset: d.Offset,
		Reason: d.Reason, Error: d.Error, Attempts: d.Attempts, DeadAt: d.DeadAt, Key: d.Key, Headers: d.Headers,
		ValueSize: d.ValueSize, StoredRaw: d.StoredRaw,
	}
	if out.Headers == nil {
		out.Headers = []inbox.Header{}
	}
	if known(d.RecordTime) {
		out.RecordTime = &d.RecordTime
	}
	return out
}

func wholeJSON(d inbox.DeadLetter) deadLetterWhole {
	out := deadLetterWhole{deadLetterJSON: summaryJSON(d), Value: d.Value}
	if d.ValueSHA256 != nil {
		out.ValueSHA256 = hex.EncodeToString(d.ValueSHA256)
	}
	return out
}

// known reports whether a record time was stored (the list reads an
// unknown one as the Unix epoch).
func known(t time.Time) bool { return !t.IsZero() && t.Unix() != 0 }

func runDLQShow(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("dlq show", help{
		usage: []string{"kfn dlq show ID [flags]"},
		text: `
Prints one dead letter whole: its coordinates, reason, error, attempts, when
it was dead-lettered, and its key, value and headers. Each is printed as
text when it is valid UTF-8 without control characters (other than newline
and tab), as hex otherwise; the label says which. --json has the bytes in
base64. kfn dlq list shows the ids.`,
		examples: `
kfn dlq show 42
kfn dlq show 42 --json | jq -r .value | base64 -d > record.bin`,
	}, stderr)
	databases := bindDatabases(fs)
	function := fs.String("function", "", "the function of the dead letter, whose database holds it (with --function-databases)")
	asJSON := fs.Bool("json", false, "print JSON (bytes in base64) for scripts")
	positional, err := parseWithArgs(fs, args)
	if err != nil {
		return err
	}
	if len(positional) != 1 {
		return &usageError{msg: "give one dead letter id (kfn dlq list shows them)"}
	}
	id, err := parseID(positional[0])
	if err != nil {
		return err
	}
	pool, err := databases.open(ctx, *function)
	if err != nil {
		return err
	}
	defer pool.Close()
	d, err := operator.ShowDeadLetter(ctx, pool, id)
	if err != nil {
		return err
	}
	if *asJSON {
		return writeJSON(stdout, wholeJSON(d))
	}
	return printDeadLetter(stdout, d)
}

// parseID reads a dead letter id.
func parseID(s string) (int64, error) {
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil || id < 1 {
		return 0, &usageError{msg: fmt.Sprintf("%q is not a dead letter id (a positive number; kfn dlq list shows them)", s)}
	}
	return id, nil
}

// printDeadLetter prints a dead letter whole, for kfn dlq show.
func printDeadLetter(w io.Writer, d inbox.DeadLetter) error {
	var b strings.Builder
	field := func(name string, value any) { fmt.Fprintf(&b, "%-13s%v\n", name, value) }
	field("id", d.ID)
	field("function", d.Partition.Consumer)
	field("topic", d.Partition.Topic)
	field("partition", d.Partition.Partition)
	field("offset", d.Offset)
	field("reason", d.Reason)
	field("attempts", d.Attempts)
	field("dead at", d.DeadAt.Format(time.RFC3339Nano))
	if known(d.RecordTime) {
		field("record time", d.RecordTime.Format(time.RFC3339Nano))
	} else {
		field("record time", "unknown")
	}
	if d.StoredRaw {
		field("stored", "as one raw blob (Postgres refused the row column by column), decoded here")
	}
	b.WriteString("error:\n")
	b.WriteString(indent(safeText(d.Error)))
	writeBytes(&b, "key", d.Key, "")
	valueNote := ""
	if d.ValueSHA256 != nil {
		valueNote = fmt.Sprintf("; only the first %d of %d bytes were kept, sha256 of the whole value %x", len(d.Value), d.ValueSize, d.ValueSHA256)
	}
	writeBytes(&b, "value", d.Value, valueNote)
	if len(d.Headers) == 0 {
		b.WriteString("headers: none\n")
	}
	for i, h := range d.Headers {
		writeBytes(&b, fmt.Sprintf("header %d name", i+1), h.Key, "")
		writeBytes(&b, fmt.Sprintf("header %d value", i+1), h.Value, "")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// writeBytes prints record bytes under a label that says how they are
// shown: as text when textual, as hex (32 bytes a line) otherwise.
func writeBytes(b *strings.Builder, label string, data []byte, note string) {
	switch {
	case data == nil:
		fmt.Fprintf(b, "%s: null%s\n", label, note)
		return
	case len(data) == 0:
		fmt.Fprintf(b, "%s: empty (0 bytes)%s\n", label, note)
		return
	case textual(data):
		fmt.Fprintf(b, "%s (text, %s%s):\n", label, plural(len(data), "byte"), note)
		b.WriteString(indent(string(data)))
	default:
		fmt.Fprintf(b, "%s (hex, %s%s):\n", label, plural(len(data), "byte"), note)
		for len(data) > 0 {
			n := min(32, len(data))
			fmt.Fprintf(b, "  %x\n", data[:n])
			data = data[n:]
		}
	}
}

// textual reports whether record bytes can be shown as they are: valid
// UTF-8 without control characters other than newline and tab, and without
// the bidirectional controls that reorder what a terminal shows.
func textual(data []byte) bool {
	return utf8.Valid(data) && !bytes.ContainsFunc(data, hidden)
}

func hidden(r rune) bool {
	return (unicode.IsControl(r) && r != '\n' && r != '\t') || (r >= '\u202a' && r <= '\u202e') || (r >= '\u2066' && r <= '\u2069')
}

// safeText escapes in text from the database (an error) what textual
// refuses in record bytes, as \xNN or \u+NNNN, so that it cannot move the
// terminal's cursor.
func safeText(s string) string {
	if !strings.ContainsFunc(s, hidden) {
		return s
	}
	var b strings.Builder
	for _, r := range s {
		switch {
		case !hidden(r):
			b.WriteRune(r)
		case r < 0x100:
			fmt.Fprintf(&b, `\x%02x`, r)
		default:
			fmt.Fprintf(&b, `\u%04x`, r)
		}
	}
	return b.String()
}

// indent indents each line of s by two spaces, and ends it with a newline.
func indent(s string) string {
	s = strings.TrimSuffix(s, "\n")
	return "  " + strings.ReplaceAll(s, "\n", "\n  ") + "\n"
}

func runDLQDiscard(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("dlq discard", help{
		usage: []string{
			`kfn dlq discard ID… --reason "…" [flags]`,
			`kfn dlq discard --function F [other filters] --reason "…" [flags]`,
		},
		text: `
Deletes dead letters for good, in one transaction with one audit row each
(actor and reason; kfn audit --action discard lists them). Nothing is
applied again: the records stay handled (their inbox rows say
dead-lettered), so no worker and no idempotent replay applies them. Select
them by id, or by the filters of kfn dlq list; here --reason is why you
discard them, and --dead-reason selects by the dead letter's reason. A
filter that selects every dead letter needs --all. With --dry-run it lists
what would go and changes nothing; when ids are given, all must exist or
nothing is discarded. A discarded dead letter that parked its key (a
function with KeyOrder ParkKey) releases the key: its key_parked records
are marked for retry, and its worker applies them in offset order.`,
		examples: `
kfn dlq discard 41 42 --reason "INC-7: test orders, not to be re-driven"
kfn dlq discard --function orders --dead-reason permanent --error "decode" --dry-run --reason "bad producer, fixed in v2"
kfn dlq discard --until 720h --reason "older than 30 days" --json`,
	}, stderr)
	databases := bindDatabases(fs)
	filters := addFilterFlags(fs, "dead-reason", 0, "at most this many dead letters, the oldest first (default: all that match)")
	reason := fs.String("reason", "", "why they are discarded, for the audit log (required)")
	actorName := fs.String("actor", "", "who discards them, for the audit log (default: the OS user, as kfn-dlq-discard:user@host)")
	all := fs.Bool("all", false, "allow a discard that selects every dead letter")
	dryRun := fs.Bool("dry-run", false, "list what would be discarded; change nothing")
	asJSON := fs.Bool("json", false, "print JSON for scripts")
	positional, err := parseWithArgs(fs, args)
	if err != nil {
		return err
	}
	f, err := filters.filter("dead-reason", time.Now())
	if err != nil {
		return err
	}
	for _, p := range positional {
		id, err := parseID(p)
		if err != nil {
			return err
		}
		f.IDs = append(f.IDs, id)
	}
	// With ids, --function only says whose they are (and so which
	// database holds them, with --function-databases).
	if len(f.IDs) > 0 && (f.Topic != "" || f.Partition != nil || f.Reason != "" || f.ErrorContains != "" ||
		!f.Since.IsZero() || !f.Until.IsZero() || f.Limit > 0 || *all) {
		return &usageError{msg: "give ids (and their --function) or filters, not both"}
	}
	if strings.TrimSpace(*reason) == "" {
		return &usageError{msg: `--reason is required: say why, for the audit log (--reason "INC-7: …")`}
	}
	if slices.Contains(deadLetterReasons, *reason) && f.Reason == "" {
		return &usageError{msg: fmt.Sprintf("--reason is why you discard, for the audit log; to select the dead letters whose reason is %s, use --dead-reason %s", *reason, *reason)}
	}
	if !f.Narrows() && !*all {
		return &usageError{msg: "this would discard every dead letter: give ids or a filter (--function, --dead-reason, --until …), or say --all"}
	}
	who := *actorName
	if who == "" {
		who = actor("dlq-discard")
	}
	pool, err := databases.open(ctx, f.Consumer)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := checkSelection(ctx, pool, f.Consumer, f.Topic, partitionOf(f.Partition)); err != nil {
		return err
	}
	res, err := operator.DiscardDeadLetters(ctx, pool, operator.DiscardRequest{Filter: f, All: *all, Actor: who, Reason: *reason, DryRun: *dryRun})
	if err != nil {
		return err
	}
	if *asJSON {
		type releasedJSON struct {
			Partition      inbox.Partition `json:"partition"`
			Key            []byte          `json:"key"`
			BlockingOffset int64           `json:"blocking_offset"`
			MarkedForRetry int             `json:"marked_for_retry"`
		}
		out := struct {
			DryRun       bool             `json:"dry_run"`
			Count        int              `json:"count"`
			Actor        string           `json:"actor"`
			Reason       string           `json:"reason"`
			DeadLetters  []deadLetterJSON `json:"dead_letters"`
			ReleasedKeys []releasedJSON   `json:"released_keys,omitempty"`
		}{DryRun: res.DryRun, Count: len(res.DeadLetters), Actor: who, Reason: *reason, DeadLetters: make([]deadLetterJSON, len(res.DeadLetters))}
		for i, d := range res.DeadLetters {
			out.DeadLetters[i] = summaryJSON(d)
		}
		for _, r := range res.Released {
			out.ReleasedKeys = append(out.ReleasedKeys, releasedJSON{Partition: r.Partition, Key: r.Key, BlockingOffset: r.BlockingOffset, MarkedForRetry: r.Marked})
		}
		return writeJSON(stdout, out)
	}
	if len(res.DeadLetters) == 0 {
		fmt.Fprintln(stdout, "no dead letter matches: nothing discarded")
		return nil
	}
	if err := printDeadLetterTable(stdout, res.DeadLetters); err != nil {
		return err
	}
	if res.DryRun {
		fmt.Fprintf(stdout, "dry run: %s would be discarded; nothing changed (run again without --dry-run)\n", plural(len(res.DeadLetters), "dead letter"))
		return nil
	}
	fmt.Fprintf(stdout, "discarded %s for good, audited as %s (%s); the records stay dead-lettered in the inbox, so nothing re-applies them\n",
		plural(len(res.DeadLetters), "dead letter"), who, *reason)
	for _, r := range res.Released {
		fmt.Fprintf(stdout, "released key %s of %s (parked behind offset %d): %s marked for retry, applied in offset order by its worker\n",
			printable(r.Key), r.Partition, r.BlockingOffset, plural(r.Marked, "parked record"))
	}
	return nil
}

func runDLQPurge(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("dlq purge", help{
		usage: []string{"kfn dlq purge --older-than DURATION [flags]"},
		text: `
Deletes every dead letter dead-lettered more than DURATION ago (by the
database's clock) in one transaction, audited as one row with the count
(kfn audit --action purge). The records stay handled: nothing re-applies
them. Workers do the same on their own with --dead-letter-retention
(KFN_DEAD_LETTER_RETENTION, default 720h, 30 days). With
--function-databases it purges every database, each in its own
transaction.`,
		examples: `
kfn dlq purge --older-than 30d --dry-run
kfn dlq purge --older-than 168h --reason "INC-9: free space after the flood"`,
	}, stderr)
	databases := bindDatabases(fs)
	var older agoFlag
	fs.Var(&older, "older-than", "delete the dead letters older than this `duration`: 90m, 2h, 30d (required)")
	olderThan := &older.d
	reason := fs.String("reason", "", `why, for the audit log (default "older than DURATION")`)
	actorName := fs.String("actor", "", "who purges, for the audit log (default: the OS user, as kfn-dlq-purge:user@host)")
	dryRun := fs.Bool("dry-run", false, "count what would be purged; change nothing")
	asJSON := fs.Bool("json", false, "print JSON for scripts")
	if err := parse(fs, args); err != nil {
		return err
	}
	if !given(fs, "older-than") {
		return &usageError{msg: "--older-than is required: how old a dead letter must be to go, e.g. 30d"}
	}
	if *olderThan <= 0 {
		return &usageError{msg: fmt.Sprintf("--older-than %s must be positive (to delete chosen dead letters, use kfn dlq discard)", *olderThan)}
	}
	who := *actorName
	if who == "" {
		who = actor("dlq-purge")
	}
	var res operator.PurgeResult
	err := databases.eachDatabase(ctx, "", func(pool *pgxpool.Pool) error {
		one, err := operator.PurgeDeadLetters(ctx, pool, operator.PurgeRequest{OlderThan: *olderThan, Actor: who, Reason: *reason, DryRun: *dryRun})
		res.DryRun, res.Before, res.Count = one.DryRun, one.Before, res.Count+one.Count
		return err
	})
	if err != nil {
		return err
	}
	if *asJSON {
		return writeJSON(stdout, struct {
			DryRun bool      `json:"dry_run"`
			Count  int64     `json:"count"`
			Before time.Time `json:"before"`
		}{res.DryRun, res.Count, res.Before})
	}
	switch {
	case res.DryRun:
		fmt.Fprintf(stdout, "dry run: %s would be purged (dead-lettered before %s); nothing changed\n", plural64(res.Count, "dead letter"), res.Before.Format(time.RFC3339))
	case res.Count == 0:
		fmt.Fprintf(stdout, "no dead letter is older than %s (dead-lettered before %s): nothing purged\n", *olderThan, res.Before.Format(time.RFC3339))
	default:
		fmt.Fprintf(stdout, "purged %s (dead-lettered before %s), audited as %s\n", plural64(res.Count, "dead letter"), res.Before.Format(time.RFC3339), who)
	}
	return nil
}

// runDLQPark is the escape hatch for a record that holds its partition for
// a reason no one foresaw: it dead-letters that one record through the
// workers' lease-and-fence path, audited.
func runDLQPark(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("dlq park", help{
		usage: []string{`kfn dlq park --function F --topic T --partition P --offset N --reason "…" [flags]`},
		text: `
Dead-letters one record that its worker has not handled, with reason "parked",
and lets the partition move on. The current owner is fenced, takes the
partition again and skips the record. With --kafka-brokers the dead letter
holds the record's key, value and headers; without, only its coordinates.`,
		examples: `
kfn dlq park --function orders --topic orders --partition 3 --offset 1187 \
    --reason "INC-42: record crashes the decoder; parked until fixed"`,
	}, stderr)
	databases := bindDatabases(fs)
	natsURL := bind(fs, settings.NATSURL)
	natsSec := bindNATSSecurity(fs)
	brokers := bind(fs, settings.KafkaBrokers)
	sec := bindKafkaSecurity(fs)
	bucket := bind(fs, settings.LeaseBucket)
	function := fs.String("function", "", "the function the record is stuck in (required)")
	topic := fs.String("topic", "", "the source topic (required)")
	partition := fs.Int("partition", -1, "the partition (required)")
	offset := fs.Int64("offset", -1, "the offset of the record to park (required; kfn status shows the cursor)")
	reason := fs.String("reason", "", "why, for the audit log (required)")
	asJSON := fs.Bool("json", false, "print JSON for scripts")
	if err := parse(fs, args); err != nil {
		return err
	}
	dbURL, err := databases.of(*function)
	for _, err := range []error{err, requiredSetting(settings.NATSURL, *natsURL)} {
		if err != nil {
			return err
		}
	}
	for _, f := range []struct{ name, value string }{{"function", *function}, {"topic", *topic}, {"reason", *reason}} {
		if err := required(f.name, f.value); err != nil {
			return err
		}
	}
	if *partition < 0 {
		return &usageError{msg: "--partition is required (0 or more)"}
	}
	if *offset < 0 {
		return &usageError{msg: "--offset is required (0 or more)"}
	}
	pool, err := connectPostgres(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := checkSelection(ctx, pool, *function, *topic, int32(*partition)); err != nil {
		return err
	}
	js, closeNATS, err := connectJetStream(*natsURL, "kfn dlq park", natsSec)
	if err != nil {
		return err
	}
	defer closeNATS()
	res, err := operator.Park(ctx, pool, js, operator.ParkRequest{
		Function: *function, Topic: *topic, Partition: int32(*partition), Offset: *offset, Reason: *reason,
		Actor: actor("dlq-park"), KafkaBrokers: *brokers, KafkaSecurity: *sec, LeaseBucket: *bucket,
	})
	if err != nil {
		return err
	}
	if *asJSON {
		out := parkJSON{Function: *function, Topic: *topic, Partition: int32(*partition), Offset: *offset,
			RecordRead: res.RecordRead, PreviousCursor: res.Previous.NextOffset, Cursor: res.Now.NextOffset, Epoch: res.Now.Epoch}
		if res.ReadError != nil {
			out.ReadError = res.ReadError.Error()
		}
		return writeJSON(stdout, out)
	}
	record := "with the record's key, value and headers"
	switch {
	case res.ReadError != nil:
		record = fmt.Sprintf("without its bytes (could not read it: %v)", res.ReadError)
	case !res.RecordRead:
		record = "without its bytes (no --kafka-brokers)"
	}
	fmt.Fprintf(stdout, "%s/%s/%d@%d: dead-lettered as parked, %s; cursor %d -> %d; a worker resumes within a few seconds\n",
		*function, *topic, *partition, *offset, record, res.Previous.NextOffset, res.Now.NextOffset)
	return nil
}

// parkJSON is what kfn dlq park --json prints.
type parkJSON struct {
	Function       string `json:"function"`
	Topic          string `json:"topic"`
	Partition      int32  `json:"partition"`
	Offset         int64  `json:"offset"`
	RecordRead     bool   `json:"record_read"`          // the dead letter holds the record's bytes
	ReadError      string `json:"read_error,omitempty"` // why they could not be read
	PreviousCursor int64  `json:"previous_cursor"`
	Cursor         int64  `json:"cursor"`
	Epoch          int64  `json:"epoch"`
}

// plural says "1 dead letter", "2 dead letters".
func plural(n int, noun string) string { return plural64(int64(n), noun) }

func plural64(n int64, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// maxShownHeaders and maxShownBytes keep a table row readable; --json has
// everything.
const (
	maxShownHeaders = 8
	maxShownBytes   = 40
)

// printable shows record bytes in a table cell: as text when they are
// printable UTF-8 (no control characters, no ',' or '=' that would blur the
// header list), as 0x-hex otherwise, cut to maxShownBytes; "-" for null.
func printable(b []byte) string {
	if b == nil {
		return "-"
	}
	cut := ""
	if len(b) > maxShownBytes {
		b, cut = b[:maxShownBytes], fmt.Sprintf("…(%d bytes)", len(b))
	}
	if utf8.Valid(b) && !bytes.ContainsFunc(b, func(r rune) bool { return !unicode.IsPrint(r) || r == ',' || r == '=' }) {
		return string(b) + cut
	}
	return "0x" + hex.EncodeToString(b) + cut
}
