package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/outbox"
)

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("status", help{
		usage: []string{"kfn status [--function F] [--json] [--watch D]"},
		text: `
Shows every lane of every function (or of one): owner, epoch, lease holder
(with --nats-url), cursor, high watermark or ack floor, lag, last commit.
With --function-databases it reads each function's own database, and
without --function every database in turn.`,
		examples: `
kfn status --function orders
kfn status --json | jq '.[] | select(.lag > 1000)'
kfn status --watch 2s
kfn status --database-url "$ORDERS_DB" --function-databases "ledger=$LEDGER_DB"`,
	}, stderr)
	databases := bindDatabases(fs)
	brokers := bind(fs, settings.KafkaBrokers)
	sec := bindKafkaSecurity(fs)
	nats := settings.NATSURL
	nats.Usage += "; with it, the live lease holders and the JetStream consumers of NATS-triggered functions are shown"
	natsURL := bind(fs, nats)
	natsSec := bindNATSSecurity(fs)
	bucket := bind(fs, settings.LeaseBucket)
	function := fs.String("function", "", "only this function (default: all)")
	asJSON := fs.Bool("json", false, "print JSON for scripts")
	watch := fs.Duration("watch", 0, "print the status again every DURATION until Ctrl-C (the screen is cleared first on a terminal)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *watch < 0 || given(fs, "watch") && *watch < 100*time.Millisecond {
		return &usageError{msg: fmt.Sprintf("--watch %s is too short: 100ms or more", *watch)}
	}
	urls, err := databases.urls(*function)
	if err != nil {
		return err
	}
	pools, closeAll, err := connectAll(ctx, urls)
	defer closeAll()
	if err != nil {
		return err
	}
	for _, pool := range pools {
		if err := operator.CheckFunction(ctx, pool, *function); err != nil {
			return err
		}
	}
	var js jetstream.JetStream
	if *natsURL != "" {
		var closeNATS func()
		js, closeNATS, err = connectJetStream(*natsURL, "kfn status", natsSec)
		if err != nil {
			return err
		}
		defer closeNATS()
	}
	readers := make([]*operator.StatusReader, len(pools))
	for i, pool := range pools {
		readers[i] = operator.NewStatusReaderSecure(pool, *brokers, *sec, js, *bucket)
		defer readers[i].Close()
	}
	if *watch == 0 {
		return printStatus(ctx, stdout, pools, readers, *function, *asJSON, js != nil, len(*brokers) > 0)
	}
	tty := isTerminal(stdout)
	tick := time.NewTicker(*watch)
	defer tick.Stop()
	for {
		if tty {
			fmt.Fprint(stdout, "\033[H\033[2J")
		}
		if !*asJSON {
			fmt.Fprintf(stdout, "kfn status every %s, at %s (Ctrl-C to stop)\n", *watch, time.Now().Format(time.TimeOnly))
		}
		if err := printStatus(ctx, stdout, pools, readers, *function, *asJSON, js != nil, len(*brokers) > 0); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			fmt.Fprintf(stderr, "kfn status: %v\n", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		if !tty && !*asJSON {
			fmt.Fprintln(stdout)
		}
	}
}

// printStatus reads the status of every lane once, from each database,
// and prints it as a table or as JSON, with each database's WAL outbox
// slot when it has one. When NATS or Kafka could not be
// asked it prints what it has, then returns the error.
func printStatus(ctx context.Context, stdout io.Writer, pools []*pgxpool.Pool, readers []*operator.StatusReader, function string, asJSON, withNATS, withKafka bool) error {
	var parts []operator.PartitionStatus
	var statusErr error
	for _, reader := range readers {
		these, err := reader.Read(ctx, function)
		if these == nil && err != nil {
			return err
		}
		parts = append(parts, these...)
		statusErr = errors.Join(statusErr, err)
	}
	if asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if parts == nil {
			parts = []operator.PartitionStatus{}
		}
		if err := enc.Encode(parts); err != nil {
			return err
		}
		return statusErr
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "FUNCTION\tKIND\tTOPIC / SUBJECT\tPARTITION\tOWNER\tEPOCH\tLEASE\tCURSOR\tKAFKA HIGH\tACK FLOOR\tLAG\tLAST COMMIT")
	for _, p := range parts {
		leaseCol := "?"
		switch {
		case withNATS && p.LeaseHolder == "":
			leaseCol = "free"
		case withNATS:
			leaseCol = fmt.Sprintf("%s (token %d)", p.LeaseHolder, p.LeaseToken)
		}
		high, floor := unknownIfNegative(p.KafkaHighMark), "-"
		if p.Kind == operator.KindSubject {
			high, floor = "-", "?"
			if p.AckFloor != nil {
				floor = fmt.Sprint(*p.AckFloor)
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%d\t%s\t%d\t%s\t%s\t%s\t%s ago\n", p.Function, p.Kind, p.Topic, p.Partition, p.Owner, p.Epoch, leaseCol, p.Cursor,
			high, floor, unknownIfNegative(p.Lag), p.LastCommitAge)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(parts) == 0 {
		fmt.Fprintln(stdout, "no partitions have been claimed yet")
	}
	switch {
	case len(parts) == 0:
	case !withNATS && !withKafka:
		fmt.Fprintln(stdout, "(LEASE and the NATS lanes' ACK FLOOR and LAG need --nats-url; KAFKA HIGH and the Kafka lanes' LAG need --kafka-brokers)")
	case !withNATS:
		fmt.Fprintln(stdout, "(LEASE and the NATS lanes' ACK FLOOR and LAG need --nats-url)")
	case !withKafka:
		fmt.Fprintln(stdout, "(KAFKA HIGH and the Kafka lanes' LAG need --kafka-brokers)")
	}
	for _, p := range parts {
		if len(p.KeyLanes) == 0 {
			continue
		}
		progress := make([]string, len(p.KeyLanes))
		for i, k := range p.KeyLanes {
			progress[i] = fmt.Sprintf("%d:%d", k.Lane, k.NextOffset)
		}
		waits := "nothing committed above the cursor"
		if p.Ahead > 0 {
			waits = fmt.Sprintf("committed up to %d past the cursor; the cursor waits on key-lane %s", p.Ahead, joinInts(p.WaitsOn))
		}
		fmt.Fprintf(stdout, "key-lanes of %s/%s/%d (key-lane:next offset): %s; %s\n", p.Function, p.Topic, p.Partition, strings.Join(progress, " "), waits)
	}
	for _, p := range parts {
		if p.Problem != "" {
			fmt.Fprintf(stdout, "note: %s/%s/%d: %s\n", p.Function, p.Topic, p.Partition, p.Problem)
		}
	}
	for _, pool := range pools {
		if wal, err := outbox.ReadWALState(ctx, pool); err != nil {
			statusErr = errors.Join(statusErr, err)
		} else if wal.SetUp {
			fmt.Fprintln(stdout, walStatusLine(wal, time.Now()))
		}
	}
	return statusErr
}

// walStatusLine says what the WAL outbox's slot holds back and who reads
// it, or that it is lost.
func walStatusLine(w outbox.WALState, now time.Time) string {
	if w.Lost() {
		return fmt.Sprintf("WAL outbox: slot %s is LOST (found gone %s): events emitted and not relayed before are lost, and workers with --outbox wal cannot commit; run `kfn migrate --outbox wal` and see docs/production/wal-outbox.md#slot-loss",
			w.Slot, ago(w.LostAt, now))
	}
	reader := "no relay reads it"
	if w.ActivePID != 0 {
		reader = fmt.Sprintf("read by %s (token %d, walsender pid %d)", w.Reader, w.FenceToken, w.ActivePID)
	}
	if !w.RetiredAt.IsZero() {
		left := "drained: run `kfn migrate --drop-wal-outbox` to drop it"
		if !w.Drained() {
			left = fmt.Sprintf("%d bytes of WAL from before the retirement left to relay, %d events read and not yet acked", w.RetireLeftBytes, w.Pending)
		}
		return fmt.Sprintf("WAL outbox: slot %s RETIRED since %s (emits refused); %s; %s", w.Slot, ago(w.RetiredAt, now), left, reader)
	}
	oldest := "none"
	if w.Pending > 0 && !w.OldestPending.IsZero() {
		oldest = "emitted " + ago(w.OldestPending, now)
	}
	return fmt.Sprintf("WAL outbox: slot %s %s; holds %d bytes of WAL; %d events read and not yet acked (oldest %s); last report %s",
		w.Slot, reader, w.LagBytes, w.Pending, oldest, ago(w.ReportedAt, now))
}

// ago is how long before now t was, or "never" for the zero time.
func ago(t, now time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return now.Sub(t).Round(time.Millisecond).String() + " ago"
}

func unknownIfNegative(n int64) string {
	if n < 0 {
		return "?"
	}
	return fmt.Sprint(n)
}

// joinInts lists ns as "1, 4 or 7".
func joinInts(ns []int) string {
	out := make([]string, len(ns))
	for i, n := range ns {
		out[i] = fmt.Sprint(n)
	}
	if len(out) < 2 {
		return strings.Join(out, "")
	}
	return strings.Join(out[:len(out)-1], ", ") + " or " + out[len(out)-1]
}
