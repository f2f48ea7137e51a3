package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"unicode"
	"unicode/utf8"

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
			d.Offset, d.Reason, d.Attempts, d.DeadAt.Format("2006-01-02 15:04:05"), printable(d.Key), strings.Join(headers, ","), firstLine)
	}
	return tw.Flush()
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
