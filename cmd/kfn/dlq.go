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
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/operator"
)

func runDLQ(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 {
		switch args[0] {
		case "park":
			return runDLQPark(ctx, args[1:], stdout, stderr)
		case "retry":
			return runDLQRetry(ctx, args[1:], stdout, stderr)
		case "list":
			args = args[1:]
		}
	}
	fs := newFlags("dlq", stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), `usage: kfn dlq [list] [flags]      list dead-lettered records
       kfn dlq park [flags]        dead-letter one stuck record by hand (see kfn dlq park -h)
       kfn dlq retry [flags]       run dead letters through their function again, once (see kfn dlq retry -h)

`)
		printFlags(fs.FlagSet)
	}
	dbURL := bind(fs, settings.DatabaseURL)
	function := fs.String("function", "", "only this function (default: all)")
	limit := fs.Int("limit", 100, "at most this many records")
	asJSON := fs.Bool("json", false, "print JSON (with payloads) for scripts")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := requiredSetting(settings.DatabaseURL, *dbURL); err != nil {
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

// runDLQPark is the escape hatch for a record that holds its partition for
// a reason no one foresaw: it dead-letters that one record through the
// workers' lease-and-fence path, audited.
func runDLQPark(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("dlq park", stderr)
	dbURL := bind(fs, settings.DatabaseURL)
	natsURL := bind(fs, settings.NATSURL)
	brokers := bind(fs, settings.KafkaBrokers)
	bucket := bind(fs, settings.LeaseBucket)
	function := fs.String("function", "", "the function the record is stuck in (required)")
	topic := fs.String("topic", "", "the source topic (required)")
	partition := fs.Int("partition", -1, "the partition (required)")
	offset := fs.Int64("offset", -1, "the offset of the record to park (required; kfn status shows the cursor)")
	reason := fs.String("reason", "", "why, for the audit log (required)")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), `usage: kfn dlq park --function F --topic T --partition P --offset N --reason "…" [flags]

Dead-letters one record that its worker has not handled, with reason "parked",
and lets the partition move on. The current owner is fenced, takes the
partition again and skips the record. With --kafka-brokers the dead letter
holds the record's key, value and headers; without, only its coordinates.

example:
  kfn dlq park --function orders --topic orders --partition 3 --offset 1187 \
      --reason "INC-42: record crashes the decoder; parked until fixed"

`)
		printFlags(fs.FlagSet)
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	for _, err := range []error{requiredSetting(settings.DatabaseURL, *dbURL), requiredSetting(settings.NATSURL, *natsURL)} {
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
	pool, err := connectPostgres(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	js, closeNATS, err := connectJetStream(*natsURL, "kfn dlq park")
	if err != nil {
		return err
	}
	defer closeNATS()
	res, err := operator.Park(ctx, pool, js, operator.ParkRequest{
		Function: *function, Topic: *topic, Partition: int32(*partition), Offset: *offset, Reason: *reason,
		Actor: actor("dlq-park"), KafkaBrokers: *brokers, LeaseBucket: *bucket,
	})
	if err != nil {
		return err
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
