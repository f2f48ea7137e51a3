package operator

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/internal/naming"
	"github.com/kfn-dev/kfn/runtime"
)

// Replay moves the cursor of the one partition spec names (spec.Partitions
// holds exactly one) through the same fencing the workers use (see
// withSeizedPartition), and writes the audit log in the same transaction.
// A worker then takes the partition again and resumes at the new cursor.
func Replay(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, spec ReplaySpec) (inbox.ReplayResult, error) {
	if len(spec.Partitions) != 1 {
		return inbox.ReplayResult{}, fmt.Errorf("a replay of one partition names one, not %d (ReplayPartitions replays several)", len(spec.Partitions))
	}
	out, err := ReplayPartitions(ctx, pool, js, spec)
	if err != nil {
		return inbox.ReplayResult{}, err
	}
	if len(out) != 1 || out[0].Result == nil {
		return inbox.ReplayResult{}, fmt.Errorf("replay of %s/%s/%d did nothing", spec.Function, spec.Topic, spec.Partitions[0])
	}
	return *out[0].Result, nil
}

// ReplaySpec asks to replay one or more partitions of a function's topic.
type ReplaySpec struct {
	Function string
	Topic    string
	// Partitions to replay; none: every partition of the topic that has a
	// cursor for the function.
	Partitions []int32
	// From is the offset to resume at in every partition, or, when FromTime
	// is set (From is then ignored), the first offset of each partition
	// whose record's timestamp is at or after FromTime (Kafka's
	// offsets-for-times; needs KafkaBrokers).
	From     int64
	FromTime time.Time
	// ReplayOptions: how far, whether to re-execute, who asks and why (see
	// inbox.ReplayOptions).
	inbox.ReplayOptions
	// LeaseBucket is the workers' --lease-bucket; default lease.DefaultBucket.
	LeaseBucket string
	// KafkaBrokers, when set, check the range against the records Kafka
	// holds, and take Kafka's retention into account when checking for
	// purged inbox rows.
	KafkaBrokers []string
	// KafkaSecurity is how to connect to KafkaBrokers (TLS, SASL).
	KafkaSecurity runtime.KafkaSecurity
	// DryRun validates and plans, and changes nothing: no lease is taken,
	// no epoch moves, nothing is written.
	DryRun bool
}

// PartitionReplay is the plan, and after the change the result, of one
// partition's replay.
type PartitionReplay struct {
	Plan inbox.ReplayPlan
	// FromTime: the offset Kafka's offsets-for-times gave for it, -1 when
	// no record is that recent (From is then the high watermark).
	TimeOffset int64
	// KafkaFirst and KafkaHigh are the partition's offset range in Kafka
	// (-1 without KafkaBrokers).
	KafkaFirst, KafkaHigh int64
	// Nothing says why there is nothing to replay in this partition
	// (FromTime resolved at or after its cursor); it is left alone.
	Nothing string
	// Result is what the replay changed; nil for a dry run or a partition
	// left alone.
	Result *inbox.ReplayResult
}

// ErrNoCursor means a partition to replay has no cursor: nothing was ever
// processed there, or the function, topic or partition is wrong.
var ErrNoCursor = errors.New("no cursor")

// ReplayPartitions validates spec for every partition first, and refuses
// the whole replay if any partition fails (an unknown function, topic or
// partition, a NATS-triggered function, an offset past the high-water mark
// or outside Kafka's records, an empty range, a time in the future, a
// re-execution over purged inbox rows or whose event ids cannot be kept).
// Nothing is changed before every check passed. Then, unless DryRun, it
// replays the partitions one after another, each under its own seized
// lease (see withSeizedPartition), and re-checks each under its lock. It
// returns the partitions replayed so far with an error that stopped it.
func ReplayPartitions(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, spec ReplaySpec) ([]PartitionReplay, error) {
	plans, err := planReplays(ctx, pool, js, spec)
	if err != nil || spec.DryRun {
		return plans, err
	}
	for i := range plans {
		pr := &plans[i]
		if pr.Nothing != "" {
			continue
		}
		part := pr.Plan.Partition
		var res inbox.ReplayResult
		err := withSeizedPartition(ctx, pool, js, spec.LeaseBucket, part, spec.Actor, func(tx pgx.Tx, token int64) (err error) {
			res, err = inbox.Replay(ctx, tx, pr.request(spec, token))
			return err
		})
		if err != nil {
			if i > 0 {
				err = fmt.Errorf("%w (the partitions before %d were replayed)", err, part.Partition)
			}
			return plans[:i], err
		}
		pr.Result = &res
		pr.Plan = res.Plan // as checked under the lock: the cursor may have moved on since
	}
	return plans, nil
}

func (pr *PartitionReplay) request(spec ReplaySpec, token int64) inbox.ReplayRequest {
	return inbox.ReplayRequest{
		Partition: pr.Plan.Partition, Token: token, From: pr.Plan.From,
		ReplayOptions: spec.ReplayOptions, KafkaFirst: max(0, pr.KafkaFirst),
	}
}

// planReplays checks spec against Postgres, NATS and Kafka without
// changing anything, and plans each partition.
func planReplays(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, spec ReplaySpec) ([]PartitionReplay, error) {
	if spec.Reexecute && spec.Reason == "" {
		return nil, errors.New("a re-execution applies records a second time: it needs a reason for the audit log")
	}
	if !spec.FromTime.IsZero() {
		if len(spec.KafkaBrokers) == 0 {
			return nil, errors.New("a replay from a time needs Kafka's brokers to resolve it to offsets")
		}
		if now := time.Now(); spec.FromTime.After(now) {
			return nil, fmt.Errorf("--from-time %s is in the future (now is %s)", spec.FromTime.Format(time.RFC3339), now.Format(time.RFC3339))
		}
	} else if spec.From < 0 {
		return nil, fmt.Errorf("the offset to replay from must be 0 or more, not %d", spec.From)
	}
	cursors, err := readCursors(ctx, pool, spec)
	if err != nil {
		return nil, err
	}
	if err := refuseSubjectLane(ctx, pool, js, spec.Function, spec.Topic); err != nil {
		return nil, err
	}
	parts := make([]int32, len(cursors))
	plans := make([]PartitionReplay, len(cursors))
	for i, c := range cursors {
		parts[i] = c.part.Partition
		plans[i] = PartitionReplay{KafkaFirst: -1, KafkaHigh: -1, TimeOffset: -1}
		plans[i].Plan.Partition, plans[i].Plan.From = c.part, spec.From
	}
	if len(spec.KafkaBrokers) > 0 {
		if err := resolveInKafka(ctx, spec, parts, plans); err != nil {
			return nil, err
		}
	}
	var errs []error
	for i, c := range cursors {
		pr := &plans[i]
		from := pr.Plan.From
		if !spec.FromTime.IsZero() && from >= c.cursor.NextOffset {
			pr.Plan.Cursor = c.cursor
			pr.Nothing = fmt.Sprintf("the first record at or after %s is at offset %d, and the cursor is at %d already", spec.FromTime.Format(time.RFC3339), from, c.cursor.NextOffset)
			if pr.TimeOffset < 0 {
				pr.Nothing = fmt.Sprintf("no record is at or after %s (the high watermark is %d), and the cursor is at %d already", spec.FromTime.Format(time.RFC3339), from, c.cursor.NextOffset)
			}
			continue
		}
		if pr.KafkaHigh >= 0 {
			switch {
			case from > pr.KafkaHigh:
				errs = append(errs, fmt.Errorf("%w: offset %d is past the high watermark %d of %s in Kafka", inbox.ErrReplayPastHighWater, from, pr.KafkaHigh, c.part))
				continue
			case spec.To > pr.KafkaHigh:
				errs = append(errs, fmt.Errorf("%w: --to-offset %d is past the high watermark %d of %s in Kafka", inbox.ErrReplayPastHighWater, spec.To, pr.KafkaHigh, c.part))
				continue
			case from < pr.KafkaFirst:
				errs = append(errs, fmt.Errorf("offset %d of %s is gone from Kafka (retention): the first record it holds is at %d; replay from there", from, c.part, pr.KafkaFirst))
				continue
			}
		}
		req := pr.request(spec, c.cursor.Epoch)
		plan, err := inbox.PlanReplay(ctx, pool, req, c.cursor)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		pr.Plan = plan
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("nothing was replayed: %w", err)
	}
	return plans, nil
}

type partitionCursor struct {
	part   inbox.Partition
	cursor inbox.Cursor
}

// readCursors reads the cursors of the partitions to replay, and refuses
// partitions that have none.
func readCursors(ctx context.Context, pool *pgxpool.Pool, spec ReplaySpec) ([]partitionCursor, error) {
	rows, err := pool.Query(ctx, `
SELECT partition, next_offset, high_water, generation, epoch, owner FROM kfn.cursors
 WHERE consumer = $1 AND topic = $2 ORDER BY partition`, spec.Function, spec.Topic)
	if err != nil {
		return nil, fmt.Errorf("read the cursors of %s/%s: %w", spec.Function, spec.Topic, err)
	}
	all, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (partitionCursor, error) {
		pc := partitionCursor{part: inbox.Partition{Consumer: spec.Function, Topic: spec.Topic}}
		c := &pc.cursor
		err := r.Scan(&pc.part.Partition, &c.NextOffset, &c.HighWater, &c.Generation, &c.Epoch, &c.Owner)
		return pc, err
	})
	if err != nil {
		return nil, fmt.Errorf("read the cursors of %s/%s: %w", spec.Function, spec.Topic, err)
	}
	if len(all) == 0 {
		return nil, fmt.Errorf("%w: function %q has no cursor on topic %q: nothing was ever processed there, or the function or topic is wrong (kfn status lists them)",
			ErrNoCursor, spec.Function, spec.Topic)
	}
	if len(spec.Partitions) == 0 {
		return all, nil
	}
	var out []partitionCursor
	var missing []int32
	for _, p := range spec.Partitions {
		i := slices.IndexFunc(all, func(pc partitionCursor) bool { return pc.part.Partition == p })
		if i < 0 {
			missing = append(missing, p)
			continue
		}
		out = append(out, all[i])
	}
	if len(missing) > 0 {
		have := make([]int32, len(all))
		for i, pc := range all {
			have[i] = pc.part.Partition
		}
		return nil, fmt.Errorf("%w: %s/%s has no cursor on partition %v (it has on %v): check the partition (kfn status lists them)",
			ErrNoCursor, spec.Function, spec.Topic, missing, have)
	}
	return out, nil
}

// refuseSubjectLane refuses to replay a NATS-triggered function's lane: its
// cursor is a progress marker, and what it applies is decided by its event
// inbox and its JetStream consumer, not by an offset.
func refuseSubjectLane(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, function, topic string) error {
	var handledEvents bool
	err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM kfn.event_inbox WHERE consumer = $1)
	    OR EXISTS (SELECT 1 FROM kfn.subject_lanes WHERE consumer = $1 AND subject = $2)`, function, topic).Scan(&handledEvents)
	if err != nil {
		return fmt.Errorf("read the event inbox of %s: %w", function, err)
	}
	if !handledEvents {
		lane, err := findSubjectLane(ctx, js, function, topic)
		if err != nil {
			return err
		}
		handledEvents = lane != nil
	}
	if handledEvents {
		return fmt.Errorf("function %s consumes the NATS subject %s, not a Kafka topic: kfn replay moves Kafka cursors only", function, topic)
	}
	return nil
}

// resolveInKafka reads each partition's offset range from Kafka and, for a
// replay from a time, the offset that time resolves to.
func resolveInKafka(ctx context.Context, spec ReplaySpec, parts []int32, plans []PartitionReplay) error {
	k, err := newKafkaClient(spec.KafkaBrokers, spec.KafkaSecurity)
	if err != nil {
		return err
	}
	defer k.close()
	ranges, err := k.offsetRanges(ctx, spec.Topic, parts)
	if err != nil {
		return fmt.Errorf("read the offsets of topic %s from Kafka at %v: %w", spec.Topic, spec.KafkaBrokers, err)
	}
	var atTime map[int32]int64
	if !spec.FromTime.IsZero() {
		if atTime, err = k.offsetsForTime(ctx, spec.Topic, parts, spec.FromTime); err != nil {
			return fmt.Errorf("resolve --from-time in Kafka at %v: %w", spec.KafkaBrokers, err)
		}
	}
	for i, p := range parts {
		rg, ok := ranges[p]
		if !ok {
			return fmt.Errorf("Kafka has no partition %d of topic %s", p, spec.Topic)
		}
		plans[i].KafkaFirst, plans[i].KafkaHigh = rg.first, rg.high
		if atTime != nil {
			plans[i].TimeOffset = atTime[p]
			plans[i].Plan.From = atTime[p]
			if atTime[p] < 0 {
				plans[i].Plan.From = rg.high
			}
		}
	}
	return nil
}

// withSeizedPartition runs an operator's change to a partition under the
// workers' own fencing: it seizes the partition's lease (a new, larger
// token), records that token in Postgres (so the current owner's next
// commit fails), runs change in the same transaction, then releases the
// lease so that a worker takes the partition again at once.
func withSeizedPartition(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, bucket string, part inbox.Partition, actor string,
	change func(tx pgx.Tx, token int64) error) error {
	if bucket == "" {
		bucket = lease.DefaultBucket
	}
	if _, err := inbox.ReadCursor(ctx, pool, part); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("partition %s has no cursor: check the function, topic and partition (kfn status lists them)", part)
		}
		return err
	}
	store, err := lease.OpenExisting(ctx, js, bucket, slog.Default())
	if err != nil {
		return fmt.Errorf("partition leases (is --lease-bucket the workers' one?): %w", err)
	}
	installation, err := naming.InstallationID(ctx, pool)
	if err != nil {
		return err
	}
	l, err := store.Seize(ctx, naming.LeaseGroup(installation, part.Consumer, part.Topic), naming.LeaseItem(part.Partition), actor)
	if err != nil {
		return fmt.Errorf("take the lease of %s: %w", part, err)
	}
	defer store.Release(context.WithoutCancel(ctx), l) //nolint:errcheck // if it fails the lease expires after its TTL

	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// A worker frozen inside a batch holds the cursor row; do not wait
		// for it forever (the workers' next claim ends its session).
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '10s'`); err != nil {
			return err
		}
		if _, err := inbox.ClaimPartition(ctx, tx, part, int64(l.Token), actor, 0); err != nil {
			return err
		}
		return change(tx, int64(l.Token))
	})
}

// ReplayTarget is the cursor position at which the workers are done with
// what a replay of one partition asked of them: the end of a
// re-execution's range, or where the cursor was before an idempotent
// replay.
func (pr PartitionReplay) ReplayTarget() int64 {
	if pr.Plan.Reexecute > 0 {
		return pr.Plan.To
	}
	return max(pr.Plan.Cursor.NextOffset, pr.Plan.From)
}

// CursorPositions reads the cursors of the given partitions of function's
// topic, for a replay's progress.
func CursorPositions(ctx context.Context, pool *pgxpool.Pool, function, topic string, partitions []int32) (map[int32]int64, error) {
	rows, err := pool.Query(ctx, `SELECT partition, next_offset FROM kfn.cursors WHERE consumer = $1 AND topic = $2 AND partition = ANY($3)`,
		function, topic, partitions)
	if err != nil {
		return nil, fmt.Errorf("read the cursors of %s/%s: %w", function, topic, err)
	}
	out := map[int32]int64{}
	var p int32
	var next int64
	_, err = pgx.ForEachRow(rows, []any{&p, &next}, func() error {
		out[p] = next
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the cursors of %s/%s: %w", function, topic, err)
	}
	return out, nil
}
