package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/kfn-dev/kfn/inbox"
)

func runDLQ(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("dlq", stderr)
	dbURL := databaseFlag(fs)
	function := fs.String("function", "", "only this function (default: all)")
	limit := fs.Int("limit", 100, "at most this many records")
	asJSON := fs.Bool("json", false, "print JSON (with payloads) for scripts")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := required("database-url", *dbURL); err != nil {
		return err
	}
	if *limit < 1 {
		return &usageError{msg: "--limit must be at least 1"}
	}
	pool, err := connectPostgres(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	dead, err := inbox.ListDeadLetters(ctx, pool, *function, *limit)
	if err != nil {
		return err
	}
	if *asJSON {
		if dead == nil {
			dead = []inbox.DeadLetter{}
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(dead)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tFUNCTION\tTOPIC\tPARTITION\tOFFSET\tREASON\tATTEMPTS\tDEAD AT\tERROR")
	for _, d := range dead {
		firstLine, _, _ := strings.Cut(d.Error, "\n")
		fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%d\t%s\t%d\t%s\t%s\n", d.ID, d.Partition.Consumer, d.Partition.Topic, d.Partition.Partition,
			d.Offset, d.Reason, d.Attempts, d.DeadAt.Format("2006-01-02 15:04:05"), firstLine)
	}
	return tw.Flush()
}
