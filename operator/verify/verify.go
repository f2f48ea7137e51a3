package verify

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/kafkasource"
	"github.com/kfn-dev/kfn/runtime"
)

// Spec says what to verify and how.
type Spec struct {
	// Function is the function's name (its consumer in kfn's tables) and
	// Topic its Kafka source topic.
	Function string
	Topic    string
	// EffectsSQL is the user's effects query, in one of the shapes of the
	// package comment; empty: the inbox is the evidence of an effect.
	EffectsSQL string
	// UnpublishedAfter is the age from which an outbox row counts as
	// unpublished.
	UnpublishedAfter time.Duration
	// Examples bounds the examples kept per kind of violation.
	Examples int
	// KafkaBrokers and KafkaSecurity reach the source topic.
	KafkaBrokers  []string
	KafkaSecurity runtime.KafkaSecurity
	// Stream is the event stream the relay publishes to, read when Run is
	// given a JetStream.
	Stream string
	// Partitions, From and To restrict the run to a range of a Kafka
	// topic: the records of those partitions (empty: all) in offsets
	// [From, To) (a zero Bound: no bound), and only what Postgres and the
	// stream hold for them. A NATS-triggered function takes no range.
	Partitions []int32
	From, To   Bound
	// Progress, when set, gets a line every few seconds while records are
	// read.
	Progress io.Writer
}

// SpecError is a mistake in what was asked (an unknown function, an
// effects query that fails or has no accepted shape); Flag names the
// kfn verify flag to fix.
type SpecError struct {
	Flag string
	Msg  string
}

func (e *SpecError) Error() string { return "--" + e.Flag + ": " + e.Msg }

func specError(flag, format string, args ...any) error {
	return &SpecError{Flag: flag, Msg: fmt.Sprintf(format, args...)}
}

// cursor is one partition's cursor row.
type cursor struct {
	partition  int32
	next, high int64
	generation int
	epoch      int64
	// keyLanes: the partition is run as key-lanes (KeyConcurrency > 1),
	// which commit records above the cursor before it gets there.
	keyLanes bool
}

// bound is where the checked range of the partition ends: every record
// below it was handled (see the package comment).
func (c cursor) bound() int64 { return max(c.next, c.high) }

// Run verifies spec's function against the deployment behind pool, Kafka
// and, when js is not nil, the event stream. It changes nothing. A
// returned error means the check could not run; the violations are in the
// report.
func Run(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, spec Spec) (*Report, error) {
	start := time.Now()
	if spec.Examples <= 0 {
		spec.Examples = 5
	}
	rep := &Report{Function: spec.Function, Source: "kafka topic " + spec.Topic}
	rep.Violations.init(spec.Examples)
	rep.Cut.Partitions = []PartitionCut{}
	if err := spec.checkBounds(); err != nil {
		return nil, err
	}
	if n := pool.Config().MaxConns; n < 4 {
		return nil, specError("database-url", "it allows %d connections (pool_max_conns): the check reads its snapshot over 4", n)
	}
	var subject bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM kfn.subject_lanes WHERE consumer = $1 AND subject = $2)
    OR EXISTS (SELECT FROM kfn.event_inbox WHERE consumer = $1 AND subject = $2)`, spec.Function, spec.Topic).Scan(&subject); err != nil {
		return nil, fmt.Errorf("read the source of %s: %w", spec.Function, err)
	}
	if subject {
		return runSubject(ctx, pool, js, spec, rep, start)
	}
	if len(spec.KafkaBrokers) == 0 {
		return nil, specError("kafka-brokers", "no brokers: %s is a Kafka topic of %q, whose records are read from Kafka", spec.Topic, spec.Function)
	}

	// The stream's end first: every event up to it comes from a
	// transaction the snapshot below sees.
	var events *streamEvents
	if js != nil {
		stream, info, err := openEventStream(ctx, js, spec)
		if err != nil {
			return nil, err
		}
		events = &streamEvents{stream: stream, lastSeq: info.State.LastSeq}
		rep.Cut.Stream = &StreamCut{Name: spec.Stream, LastSeq: info.State.LastSeq}
	}

	tx, exported, cursors, err := openSnapshot(ctx, pool, rep, spec)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // read-only
	eff, hist, err := readEffectsAndHistory(ctx, tx, spec, rep, false)
	if err != nil {
		return nil, err
	}
	if spec.ranged() && (eff.shape == shapeKeyed || eff.shape == shapeTotal) {
		return nil, specError("effects-sql", "the query returns counts, which cannot be compared over a range (--partitions, --from, --to): return one row per applied record (source_topic, source_partition, source_offset), which is checked over the range, or leave out the range")
	}
	var parked int64
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM kfn.parked_keys WHERE consumer = $1 AND topic = $2`, spec.Function, spec.Topic).Scan(&parked); err != nil {
		return nil, fmt.Errorf("read the parked keys of %s: %w", spec.Function, err)
	}
	if parked > 0 {
		rep.Cut.Notes = append(rep.Cut.Notes, fmt.Sprintf("%d keys are parked: their later records are dead letters (reason key_parked) until the key is released, and count as dead-lettered here", parked))
	}

	klog, err := kafkasource.OpenLog(spec.KafkaBrokers, spec.KafkaSecurity)
	if err != nil {
		return nil, err
	}
	defer klog.Close()
	parts, err := readKafkaRanges(ctx, klog, spec.Topic, cursors)
	var bad *SpecError
	if err != nil && !errors.As(err, &bad) {
		return nil, fmt.Errorf("Kafka at %v does not answer (check --kafka-brokers and its TLS and SASL settings): %w", spec.KafkaBrokers, err)
	}
	if err != nil {
		return nil, err
	}
	sc, err := resolveScope(ctx, klog, spec, parts)
	if err != nil {
		return nil, err
	}
	if eff.shape == shapeKeyed || eff.shape == shapeTotal {
		for _, p := range parts {
			if p.first > 0 {
				return nil, specError("effects-sql", "the query returns counts, which are compared with every record since offset 0, but Kafka holds %s/%d only from offset %d: return one row per applied record (source_topic, source_partition, source_offset) instead",
					spec.Topic, p.id, p.first)
			}
		}
		if err := eff.readCounts(ctx, tx); err != nil {
			return nil, err
		}
	}

	if events != nil {
		generations := map[int32]int{}
		for _, c := range cursors {
			generations[c.partition] = c.generation
		}
		if err := events.read(ctx, spec, sc, generations, hist, &rep.Violations, spec.Progress); err != nil {
			return nil, err
		}
		rep.Checked.Events = int64(len(events.list))
	}

	w := &walk{spec: spec, rep: rep, klog: klog, eff: eff, hist: hist, events: events, scope: sc, started: time.Now(), lastProgress: time.Now()}
	if err := w.run(ctx, pool, exported, parts); err != nil {
		return nil, err
	}
	if err := checkOutbox(ctx, tx, spec, sc, rep); err != nil {
		return nil, err
	}
	rep.Cut.Statement = fmt.Sprintf("the records of %s below each partition's cursor (the larger of next_offset and high_water) in the Postgres snapshot, from Kafka's first offset; records from the cursor on are pending", spec.Topic)
	if sc != nil {
		rep.Cut.Range = &RangeCut{Partitions: sc.parts, From: spec.From.String(), To: spec.To.String()}
		rep.Cut.Statement = fmt.Sprintf("the records of %s in the range %s only, per partition the offsets [checked_from, checked_below): Kafka's range and the range given, below the partition's cursor (the larger of next_offset and high_water) in the Postgres snapshot; records from the cursor on are pending, and nothing outside the range is compared",
			spec.Topic, rep.Cut.Range)
	}
	if events != nil {
		rep.Cut.Statement += fmt.Sprintf("; the events of %s in stream %s up to sequence %d, read before the snapshot", spec.Function, spec.Stream, events.lastSeq)
	}
	return rep.done(start), nil
}

// readEffectsAndHistory probes the effects query's shape (events: the
// function is NATS-triggered), states it in rep, and reads the audit
// history of the function's partitions or lanes.
func readEffectsAndHistory(ctx context.Context, tx pgx.Tx, spec Spec, rep *Report, events bool) (*effects, *history, error) {
	eff, err := probeEffects(ctx, tx, spec.EffectsSQL, events)
	if err != nil {
		return nil, nil, err
	}
	rep.Cut.Effects = eff.describe()
	hist, err := readHistory(ctx, tx, spec)
	if err != nil {
		return nil, nil, err
	}
	return eff, hist, nil
}

// openEventStream finds the event stream and reads its state.
func openEventStream(ctx context.Context, js jetstream.JetStream, spec Spec) (jetstream.Stream, *jetstream.StreamInfo, error) {
	stream, err := retryNATS(ctx, func() (jetstream.Stream, error) { return js.Stream(ctx, spec.Stream) })
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, nil, specError("event-stream", "JetStream has no stream %q: name the stream the relay publishes to (or leave out --nats-url to skip the events)", spec.Stream)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("read the event stream %s: %w", spec.Stream, err)
	}
	info, err := retryNATS(ctx, func() (*jetstream.StreamInfo, error) { return stream.Info(ctx) })
	if err != nil {
		return nil, nil, fmt.Errorf("read the event stream %s: %w", spec.Stream, err)
	}
	return stream, info, nil
}

// openSnapshot begins the run's read-only snapshot, states it in rep,
// exports it for the streams' connections and reads the function's
// cursors there.
func openSnapshot(ctx context.Context, pool *pgxpool.Pool, rep *Report, spec Spec) (pgx.Tx, string, []cursor, error) {
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return nil, "", nil, fmt.Errorf("begin a read-only snapshot in Postgres: %w", err)
	}
	var at time.Time
	var snapshot, exported string
	err = tx.QueryRow(ctx, `SELECT now(), pg_current_snapshot()::text, pg_export_snapshot()`).Scan(&at, &snapshot, &exported)
	if err != nil {
		err = fmt.Errorf("take a snapshot in Postgres: %w", err)
	}
	var cursors []cursor
	if err == nil {
		rep.Cut.Snapshot = fmt.Sprintf("one REPEATABLE READ snapshot taken at %s (%s)", at.UTC().Format(time.RFC3339Nano), snapshot)
		cursors, err = readCursors(ctx, tx, spec)
	}
	if err != nil {
		tx.Rollback(ctx) //nolint:errcheck // read-only
		return nil, "", nil, err
	}
	return tx, exported, cursors, nil
}

// readCursors reads the function's cursors on the topic (or subject: one
// per lane): no cursor at all is an unknown function (or one that never
// ran), a mistake of --function or --topic.
func readCursors(ctx context.Context, tx pgx.Tx, spec Spec) ([]cursor, error) {
	rows, err := tx.Query(ctx, `SELECT partition, next_offset, high_water, generation, epoch,
       EXISTS (SELECT FROM kfn.key_lanes k WHERE k.consumer = c.consumer AND k.topic = c.topic AND k.partition = c.partition)
  FROM kfn.cursors c
 WHERE consumer = $1 AND topic = $2 ORDER BY partition`, spec.Function, spec.Topic)
	if err != nil {
		return nil, fmt.Errorf("read the cursors of %s: %w", spec.Function, err)
	}
	var out []cursor
	var c cursor
	if _, err := pgx.ForEachRow(rows, []any{&c.partition, &c.next, &c.high, &c.generation, &c.epoch, &c.keyLanes}, func() error {
		out = append(out, c)
		return nil
	}); err != nil {
		return nil, fmt.Errorf("read the cursors of %s: %w", spec.Function, err)
	}
	if len(out) > 0 {
		return out, nil
	}
	var topics []string
	if err := tx.QueryRow(ctx, `SELECT coalesce(array_agg(DISTINCT topic ORDER BY topic), '{}') FROM kfn.cursors WHERE consumer = $1`, spec.Function).Scan(&topics); err != nil {
		return nil, fmt.Errorf("read the cursors of %s: %w", spec.Function, err)
	}
	if len(topics) > 0 {
		return nil, specError("topic", "function %q has no cursor on topic %q; its sources are %v", spec.Function, spec.Topic, topics)
	}
	return nil, specError("function", "no function %q in this database: it has no cursor (no worker of it ever claimed a partition); `kfn status` lists the functions", spec.Function)
}

// kafkaPartition is one partition of the source: Kafka's range and the
// function's cursor there (nil: none yet).
type kafkaPartition struct {
	id          int32
	first, high int64
	cursor      *cursor
	// listed: Kafka lists the partition (else only a cursor names it).
	listed bool
}

// readKafkaRanges asks Kafka for the range of every partition of the topic
// and of every partition that has a cursor.
func readKafkaRanges(ctx context.Context, klog *kafkasource.Log, topic string, cursors []cursor) ([]kafkaPartition, error) {
	ids, err := klog.Partitions(ctx, topic)
	if errors.Is(err, kafkasource.ErrTopicMissing) {
		return nil, specError("topic", "Kafka has no topic %q", topic)
	}
	if err != nil {
		return nil, err
	}
	byID := map[int32]*kafkaPartition{}
	var out []kafkaPartition
	for _, id := range ids {
		first, high, err := klog.OffsetRange(ctx, topic, id)
		if err != nil {
			return nil, err
		}
		out = append(out, kafkaPartition{id: id, first: first, high: high, listed: true})
	}
	for i := range out {
		byID[out[i].id] = &out[i]
	}
	var extra []kafkaPartition // partitions with a cursor that Kafka does not list
	for i := range cursors {
		c := &cursors[i]
		if p, ok := byID[c.partition]; ok {
			p.cursor = c
			continue
		}
		extra = append(extra, kafkaPartition{id: c.partition, cursor: c})
	}
	out = append(out, extra...)
	slices.SortFunc(out, func(a, b kafkaPartition) int { return int(a.id) - int(b.id) })
	return out, nil
}
