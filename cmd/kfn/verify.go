package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/operator/verify"
	"github.com/kfn-dev/kfn/runtime"
)

var verifyHelp = help{
	usage: []string{"kfn verify --function F --topic T [--effects-sql SQL | --effects-sql-file FILE] [flags]"},
	text: `
Checks, read-only, that function F applied every record of Kafka topic T
exactly once: every record Kafka holds below the function's cursors against
kfn's inbox, dead letters and outbox, the function's events in the event
stream (with --nats-url) and the business effects (with --effects-sql).
For a NATS-triggered function T is its subject (--nats-url is then
required, --kafka-brokers not): every event on T in the event stream below
its lane's cursor against the event inbox and the effects, and the
function's own events in that stream against the events on T they came of.
It reports lost, duplicated, unexpected, fenced_but_committed, unpublished
and out_of_order, each with a count and examples, and the consistent cut it
read below. Exit code: 0 no violation, 1 at least one, 2 it could not check
(a flag, the query, or a service that does not answer).

--effects-sql returns one of three shapes, told apart by its columns:
  (source_topic, source_partition, source_offset)  one row per applied record
  (key, count)   how many records changed each Kafka record key
  (count)        one total
The counting shapes need Kafka to hold the topic from offset 0.
For a NATS-triggered function the per-record shape is (event_id), one row
per applied event, and the counting shapes count per event key.

--partitions, --from and --to check a range of a Kafka topic only: the
records of those partitions in offsets [from, to), and only what kfn's
tables and the stream hold for them; nothing outside the range is
compared. A bound is an offset (1200000), an RFC 3339 time
(2026-12-05T03:00:00Z) or an age (1h: an hour ago); a time is, in each
partition, the first record whose timestamp is at or after it (Kafka's
time index). The report's cut names the offsets checked per partition.
Over a range the effects query must be the per-record shape, and a
NATS-triggered function takes no range.`,
	examples: `
kfn verify --function orders --topic orders --effects-sql 'SELECT order_id, revisions FROM orders'
kfn verify --function orders --topic orders --nats-url nats://localhost:4222 --json | jq .violations
kfn verify --function orders --topic orders --partitions 3 --from 1200000 --to 1250000
kfn verify --function orders --topic orders --from 1h --effects-sql 'SELECT source_topic, source_partition, source_offset FROM order_changes'
kfn verify --function ledger --topic orders.accepted --nats-url nats://localhost:4222 \
  --effects-sql "SELECT event_id FROM ledger_entries WHERE side = 'debit'"
kfn verify --function ledger --topic orders.accepted --function-databases "ledger=$LEDGER_DB" …`,
}

func runVerify(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("verify", verifyHelp, stderr)
	databases := bindDatabases(fs)
	brokers := bind(fs, settings.KafkaBrokers)
	sec := bindKafkaSecurity(fs)
	nats := settings.NATSURL
	nats.Usage += "; with it the function's events in the event stream are checked too"
	natsURL := bind(fs, nats)
	natsSec := bindNATSSecurity(fs)
	stream := bind(fs, settings.EventStream)
	function := fs.String("function", "", "the function to verify (required)")
	topic := fs.String("topic", "", "its source Kafka topic, or NATS subject (required)")
	effectsSQL := fs.String("effects-sql", "", "`SQL` returning the business effects, in one of the shapes above (default: the inbox is the evidence)")
	effectsFile := fs.String("effects-sql-file", "", "`file` holding --effects-sql")
	unpublished := fs.Duration("unpublished-after", time.Minute, "an outbox row older than this counts as unpublished")
	examples := fs.Int("examples", 5, "examples kept per kind of violation")
	asJSON := fs.Bool("json", false, "print one JSON object for scripts")
	partitions := fs.String("partitions", "", "check only these `partitions` of a Kafka topic, e.g. 0,3,7 (default: all)")
	fromText := fs.String("from", "", "check only the records from this `bound` on: an offset, an RFC 3339 time or an age (1h: an hour ago)")
	toText := fs.String("to", "", "check only the records before this `bound`: an offset, an RFC 3339 time or an age")
	if err := parse(fs, args); err != nil {
		return err
	}
	parts, from, to, err := parseRange(*partitions, *fromText, *toText, time.Now())
	if err != nil {
		return err
	}
	dbURL, dbErr := databases.of(*function)
	for _, err := range []error{dbErr, required("function", *function), required("topic", *topic)} {
		if err != nil {
			return err
		}
	}
	if *effectsSQL != "" && *effectsFile != "" {
		return &usageError{msg: "--effects-sql and --effects-sql-file exclude each other"}
	}
	if *effectsFile != "" {
		b, err := os.ReadFile(*effectsFile)
		if err != nil {
			return &usageError{msg: fmt.Sprintf("--effects-sql-file: %v", err)}
		}
		*effectsSQL = string(b)
	}
	if *unpublished <= 0 {
		return &usageError{msg: fmt.Sprintf("--unpublished-after %s must be positive, e.g. 1m", *unpublished)}
	}
	if *examples < 1 {
		return &usageError{msg: "--examples must be 1 or more"}
	}
	rep, err := checkFunction(ctx, stderr, dbURL, *natsURL, natsSec, verify.Spec{
		Function: *function, Topic: *topic, EffectsSQL: *effectsSQL, UnpublishedAfter: *unpublished, Examples: *examples,
		KafkaBrokers: *brokers, KafkaSecurity: *sec, Stream: *stream, Progress: stderr,
		Partitions: parts, From: from, To: to,
	})
	if err != nil {
		var spec *verify.SpecError
		var usage *usageError
		switch {
		case errors.As(err, &spec):
			// The source's kind decides which service is needed.
			envs := map[string]string{settings.KafkaBrokers.Flag: settings.KafkaBrokers.Env, settings.NATSURL.Flag: settings.NATSURL.Env}
			if env, ok := envs[spec.Flag]; ok {
				return &usageError{msg: fmt.Sprintf("%s (set it or %s)", spec.Error(), env)}
			}
			return &usageError{msg: spec.Error()}
		case errors.As(err, &usage):
			return err
		}
		return &exitError{code: 2, err: err}
	}
	if *asJSON {
		err = writeJSON(stdout, rep)
	} else {
		err = rep.WriteTable(stdout)
	}
	if err != nil {
		return &exitError{code: 2, err: err}
	}
	if !rep.OK {
		return &exitError{code: 1}
	}
	return nil
}

// parseRange reads --partitions, --from and --to; a bad value is a usage
// error naming its flag.
func parseRange(partitions, from, to string, now time.Time) ([]int32, verify.Bound, verify.Bound, error) {
	parts, err := verify.ParsePartitions(partitions)
	var fromBound, toBound verify.Bound
	if err == nil {
		fromBound, err = verify.ParseBound("from", from, now)
	}
	if err == nil {
		toBound, err = verify.ParseBound("to", to, now)
	}
	if err != nil {
		return nil, verify.Bound{}, verify.Bound{}, &usageError{msg: err.Error()}
	}
	return parts, fromBound, toBound, nil
}

// checkFunction connects and runs the check.
func checkFunction(ctx context.Context, stderr io.Writer, dbURL, natsURL string, natsSec *runtime.NATSSecurity, spec verify.Spec) (*verify.Report, error) {
	pool, err := connectPostgres(ctx, dbURL)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	var js jetstream.JetStream
	if natsURL != "" {
		var closeNATS func()
		js, closeNATS, err = connectJetStream(natsURL, appName, natsSec)
		if err != nil {
			return nil, err
		}
		defer closeNATS()
	} else {
		fmt.Fprintf(stderr, "kfn verify: no --%s (%s): the events are not checked\n", settings.NATSURL.Flag, settings.NATSURL.Env)
	}
	return verify.Run(ctx, pool, js, spec)
}
