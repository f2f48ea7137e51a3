package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/operator"
)

func runAudit(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("audit", help{
		usage: []string{"kfn audit [flags]"},
		text: `
Lists kfn.audit_log: when, who (actor), what (action), on which function,
topic and partition, the details and the reason. The newest --limit rows
are shown, oldest first. The actions: replay and reexecute (kfn replay),
park (kfn dlq park), discard and purge (kfn dlq discard, kfn dlq purge and
the workers' --dead-letter-retention), skip_expired (a worker skipping
offsets Kafka deleted before they were handled), and claim: a worker's
partition claim, written on every lease claim. Claims would drown the rest,
so they are shown only with --action claim. Each database keeps the audit
log of its functions: with --function-databases and no --function, kfn
audit reads every database.`,
		examples: `
kfn audit --since 24h
kfn audit --function orders --action reexecute
kfn audit --actor alice --limit 20 --json
kfn audit --action claim --function orders --since 10m`,
	}, stderr)
	databases := bindDatabases(fs)
	function := fs.String("function", "", "only this function (default: all)")
	action := fs.String("action", "", "only this action: "+strings.Join(operator.AuditActions, ", ")+" (default: all but claim)")
	actorText := fs.String("actor", "", "only rows whose actor contains this (case-sensitive)")
	since := addTimeFlag(fs, "since", "only rows at or after this time")
	until := addTimeFlag(fs, "until", "only rows before this time")
	limit := fs.Int("limit", 100, "at most this many rows, the newest")
	asJSON := fs.Bool("json", false, "print JSON for scripts")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *limit < 1 {
		return &usageError{msg: "--limit must be at least 1"}
	}
	if err := operator.CheckAuditAction(*action); err != nil {
		return &usageError{msg: err.Error()}
	}
	f := operator.AuditFilter{Consumer: *function, Action: *action, ActorContains: *actorText, Limit: *limit + 1, Since: *since, Until: *until}
	var entries []inbox.AuditEntry
	err := databases.eachDatabase(ctx, *function, func(pool *pgxpool.Pool) error {
		if err := operator.CheckFunction(ctx, pool, *function); err != nil {
			return err
		}
		these, err := operator.AuditLog(ctx, pool, f)
		entries = append(entries, these...)
		return err
	})
	if err != nil {
		return err
	}
	// From several databases: the newest of them all, oldest first.
	slices.SortStableFunc(entries, func(a, b inbox.AuditEntry) int { return a.At.Compare(b.At) })
	if len(entries) > *limit+1 {
		entries = entries[len(entries)-*limit-1:]
	}
	if len(entries) > *limit {
		entries = entries[1:] // the oldest of limit+1
		defer fmt.Fprintf(stderr, "kfn audit: only the newest %d shown; more match: narrow the filters (--since) or raise --limit\n", *limit)
	}
	rows := make([]auditJSON, len(entries))
	for i, e := range entries {
		if rows[i], err = auditRow(e); err != nil {
			return err
		}
	}
	if *asJSON {
		return writeJSON(stdout, rows)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "AT\tACTOR\tACTION\tFUNCTION\tTOPIC\tPARTITION\tREASON\tDETAILS")
	for _, r := range rows {
		partition := "-"
		if r.Partition != nil {
			partition = fmt.Sprint(*r.Partition)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.At.Format("2006-01-02 15:04:05"), safeText(r.Actor), r.Action,
			dash(r.Function), dash(r.Topic), partition, dash(safeText(oneLine(r.Reason))), safeText(details(r.Details)))
	}
	return tw.Flush()
}

// auditJSON is one audit row in kfn's JSON output.
type auditJSON struct {
	ID        int64          `json:"id"`
	At        time.Time      `json:"at"`
	Actor     string         `json:"actor"`
	Action    string         `json:"action"`
	Function  string         `json:"function"`
	Topic     string         `json:"topic"`
	Partition *int32         `json:"partition"` // null for an action on no single partition (a purge)
	Reason    string         `json:"reason"`    // the details' reason, if any
	Details   map[string]any `json:"details"`
}

func auditRow(e inbox.AuditEntry) (auditJSON, error) {
	r := auditJSON{ID: e.ID, At: e.At, Actor: e.Actor, Action: e.Action, Function: e.Partition.Consumer, Topic: e.Partition.Topic}
	if e.Partition.Partition >= 0 {
		p := e.Partition.Partition
		r.Partition = &p
	}
	dec := json.NewDecoder(bytes.NewReader(e.Details))
	dec.UseNumber() // offsets and epochs print as they are
	if err := dec.Decode(&r.Details); err != nil {
		return r, fmt.Errorf("audit row %d: details: %w", e.ID, err)
	}
	if reason, ok := r.Details["reason"].(string); ok {
		r.Reason = reason
	}
	return r, nil
}

// details prints an audit row's details but its reason as key=value, in key
// order.
func details(d map[string]any) string {
	keys := make([]string, 0, len(d))
	for k := range d {
		if k != "reason" {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		v := d[k]
		var s string
		switch v := v.(type) {
		case string:
			s = oneLine(v)
			if s == "" || strings.ContainsAny(s, " =\"") {
				s = fmt.Sprintf("%q", s)
			}
		case json.Number:
			s = v.String()
		default:
			b, _ := json.Marshal(v)
			s = string(b)
		}
		parts[i] = k + "=" + s
	}
	return strings.Join(parts, " ")
}

// oneLine is the first line of s, marked when there is more.
func oneLine(s string) string {
	if first, _, more := strings.Cut(s, "\n"); more {
		return first + " …"
	}
	return s
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
