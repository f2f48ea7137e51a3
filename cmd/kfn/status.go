package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/operator"
)

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("status", stderr)
	dbURL := bind(fs, settings.DatabaseURL)
	brokers := bind(fs, settings.KafkaBrokers)
	nats := settings.NATSURL
	nats.Usage += "; with it, the live lease holders are shown"
	natsURL := bind(fs, nats)
	bucket := bind(fs, settings.LeaseBucket)
	function := fs.String("function", "", "only this function (default: all)")
	asJSON := fs.Bool("json", false, "print JSON for scripts")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := requiredSetting(settings.DatabaseURL, *dbURL); err != nil {
		return err
	}
	pool, err := connectPostgres(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	var js jetstream.JetStream
	if *natsURL != "" {
		var closeNATS func()
		js, closeNATS, err = connectJetStream(*natsURL, "kfn status")
		if err != nil {
			return err
		}
		defer closeNATS()
	}
	parts, statusErr := operator.Status(ctx, pool, *brokers, js, *bucket, *function)
	if parts == nil && statusErr != nil {
		return statusErr
	}
	if *asJSON {
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
	fmt.Fprintln(tw, "FUNCTION\tTOPIC\tPARTITION\tOWNER\tEPOCH\tLEASE\tCURSOR\tKAFKA HIGH\tLAG\tLAST COMMIT")
	for _, p := range parts {
		leaseCol := "?"
		switch {
		case js != nil && p.LeaseHolder == "":
			leaseCol = "free"
		case js != nil:
			leaseCol = fmt.Sprintf("%s (token %d)", p.LeaseHolder, p.LeaseToken)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%d\t%s\t%d\t%s\t%s\t%s ago\n", p.Function, p.Topic, p.Partition, p.Owner, p.Epoch, leaseCol, p.Cursor,
			unknownIfNegative(p.KafkaHighMark), unknownIfNegative(p.Lag), p.LastCommitAge)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(parts) == 0 {
		fmt.Fprintln(stdout, "no partitions have been claimed yet")
	}
	return statusErr
}

func unknownIfNegative(n int64) string {
	if n < 0 {
		return "?"
	}
	return fmt.Sprint(n)
}
