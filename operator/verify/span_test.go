package verify_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/operator/verify"
	"github.com/kfn-dev/kfn/outbox"
)

// rangeOf is the report's checked offsets per partition, as
// "p:[from,below)".
func rangeOf(rep *verify.Report) string {
	var s []string
	for _, p := range rep.Cut.Partitions {
		s = append(s, fmt.Sprintf("%d:[%d,%d)", p.Partition, p.CheckedFrom, p.CheckedBelow))
	}
	return strings.Join(s, " ")
}

// eventFor returns the event the relay published for p@o.
func (d *deployment) eventFor(t *testing.T, p int32, o int64) *jetstream.RawStreamMsg {
	t.Helper()
	ctx := context.Background()
	info, err := d.stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		msg, err := d.stream.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		if msg.Header.Get(outbox.HeaderSourcePartition) == fmt.Sprint(p) && msg.Header.Get(outbox.HeaderSourceOffset) == fmt.Sprint(o) {
			return msg
		}
	}
	t.Fatalf("no event for %d@%d in the stream", p, o)
	return nil
}

// A range checks its records only, with each kind of evidence restricted
// to it: violations of every source (effects, dead letters, the outbox,
// events in the stream, inbox epochs) planted inside a range are found,
// and the same planted just outside it, on each side or in another
// partition, are not; a range with all of them outside is clean.
func TestVerifyRangeChecksOnlyItsRecords(t *testing.T) {
	d := deploy(t, 40) // partitions 0 and 1, offsets 0-19 each; 0@10 is the poison
	ctx := context.Background()
	var dead int64
	if err := d.db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.dead_letters WHERE NOT (partition = 0 AND "offset" = 10)`).Scan(&dead); err != nil || dead != 0 {
		t.Fatalf("the worker dead-lettered %d records besides the poison (err %v): the planted violations would not be the only ones", dead, err)
	}
	// Lost effects on both edges of [5, 15) of partition 0, and one just
	// past each.
	d.exec(t, `DELETE FROM effects WHERE source_partition = 0 AND source_offset IN (4, 5, 14, 15)`)
	// A second effect of a record of partition 1.
	d.exec(t, `INSERT INTO effects VALUES ($1, 1, 3)`, d.topic)
	// A dead letter of an applied record, below the range.
	if err := pgx.BeginFunc(ctx, d.db.Pool, func(tx pgx.Tx) error {
		_, err := inbox.WriteDeadLetter(ctx, tx, inbox.DeadLetter{Partition: inbox.Partition{Consumer: function, Topic: d.topic, Partition: 0}, Offset: 3,
			Reason: "permanent", Error: "planted", Attempts: 1, RecordTime: time.Now()})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// Outbox rows left behind, in the range and in partition 1.
	for i, at := range [][2]int64{{0, 7}, {1, 2}} {
		d.exec(t, `INSERT INTO kfn.outbox (event_id, subject, event_type, event_key, shard, data, source, source_topic, source_partition, source_offset, created_at)
VALUES ($1, $2, $2, 'k1', 0, '', $3, $4, $5, $6, now() - interval '2 minutes')`, fmt.Sprintf("stuck-%d", i), d.subject, function, d.topic, at[0], at[1])
	}
	// Events published again under a new id: in the range, and above it.
	for i, o := range []int64{8, 16} {
		republish(t, d.js, d.eventFor(t, 0, o), fmt.Sprintf("0f0f0f0f-0000-8000-8000-00000000000%d", i))
	}
	// Inbox rows committed by an epoch that never claimed partition 0: in
	// the range, and above it.
	d.exec(t, `UPDATE kfn.inbox SET epoch = 999 WHERE "offset" IN (12, 17) AND lane = (SELECT id FROM kfn.lanes WHERE consumer = $1 AND topic = $2 AND partition = 0)`, function, d.topic)

	ranged := func(parts []int32, from, to verify.Bound) *verify.Report {
		spec := d.spec
		spec.Partitions, spec.From, spec.To = parts, from, to
		return d.check(t, spec)
	}
	none := verify.Bound{}
	for _, tc := range []struct {
		name     string
		parts    []int32
		from, to verify.Bound
		checked  string
		records  int64
		want     map[string]int64
		examples map[string][]string
	}{
		{"partition 0, offsets [5, 15)", []int32{0}, verify.OffsetBound(5), verify.OffsetBound(15), "0:[5,15)", 10,
			map[string]int64{"lost": 2, "unpublished": 1, "duplicated": 1, "fenced_but_committed": 1},
			map[string][]string{"lost": {"0@5 has no effect", "0@14 has no effect"}, "unpublished": {"event stuck-0"},
				"duplicated": {"is a second event for 0@8"}, "fenced_but_committed": {"0@12 was committed by epoch 999"}}},
		{"partition 0 below 5", []int32{0}, none, verify.OffsetBound(5), "0:[0,5)", 5,
			map[string]int64{"lost": 1, "duplicated": 1, "unexpected": 1},
			map[string][]string{"lost": {"0@4 has no effect"}, "duplicated": {"0@3 was dead-lettered and has 1 effects"}, "unexpected": {"for 0@3, which was dead-lettered"}}},
		{"partition 0 from 15", []int32{0}, verify.OffsetBound(15), none, "0:[15,20)", 5,
			map[string]int64{"lost": 1, "duplicated": 1, "fenced_but_committed": 1},
			map[string][]string{"lost": {"0@15 has no effect"}, "duplicated": {"is a second event for 0@16"}, "fenced_but_committed": {"0@17 was committed by epoch 999"}}},
		{"partition 1", []int32{1}, none, none, "1:[0,20)", 20,
			map[string]int64{"duplicated": 1, "unpublished": 1},
			map[string][]string{"duplicated": {"1@3 has 2 effects"}, "unpublished": {"event stuck-1"}}},
		{"both partitions, offsets [18, 20)", nil, verify.OffsetBound(18), verify.OffsetBound(20), "0:[18,20) 1:[18,20)", 4, nil, nil},
		{"partitions 1, 0, 1 (a caller's list), offsets [18, 20)", []int32{1, 0, 1}, verify.OffsetBound(18), verify.OffsetBound(20), "0:[18,20) 1:[18,20)", 4, nil, nil},
		{"partition 0, offsets [6, 7)", []int32{0}, verify.OffsetBound(6), verify.OffsetBound(7), "0:[6,7)", 1, nil, nil},
	} {
		rep := ranged(tc.parts, tc.from, tc.to)
		if bad := found(rep, tc.want, tc.examples); bad != "" || rangeOf(rep) != tc.checked || rep.Checked.Records != tc.records {
			t.Errorf("%s: %s; checked %s (%d records), want %s (%d)", tc.name, bad, rangeOf(rep), rep.Checked.Records, tc.checked, tc.records)
		}
		if rep.Cut.Range == nil || !strings.Contains(rep.Cut.Statement, "in the range "+rep.Cut.Range.String()+" only") {
			t.Errorf("%s: cut %q, range %+v; want the statement to name the range", tc.name, rep.Cut.Statement, rep.Cut.Range)
		}
	}
	// The whole topic finds every one of them.
	rep := d.check(t, d.spec)
	if bad := found(rep, map[string]int64{"lost": 4, "duplicated": 4, "unexpected": 1, "unpublished": 2, "fenced_but_committed": 2}, nil); bad != "" || rep.Cut.Range != nil {
		t.Errorf("the whole topic: %s; range %+v, want none", bad, rep.Cut.Range)
	}

	// The WAL outbox slot's backlog is the whole database's: a range
	// leaves it out and says so, the whole topic counts it.
	setup, err := outbox.SetUpWAL(ctx, d.db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	defer d.exec(t, `SELECT pg_drop_replication_slot($1)`, setup.Slot)
	d.exec(t, `UPDATE kfn.wal_outbox SET pending_events = 7, oldest_pending = now() - interval '2 minutes', reported_at = now() - interval '1 second', reader = 'w-1'`)
	rep = ranged([]int32{0}, verify.OffsetBound(18), verify.Bound{})
	if bad := found(rep, nil, nil); bad != "" || !slices.ContainsFunc(rep.Cut.Notes, func(n string) bool { return strings.Contains(n, "not checked over a range") }) {
		t.Errorf("a range with a WAL outbox backlog: %s; notes %q, want none and a note that the slot is not checked", bad, rep.Cut.Notes)
	}
	if rep := d.check(t, d.spec); rep.Violations.Unpublished.Count != 2+7 {
		t.Errorf("the whole topic with a WAL outbox backlog: unpublished %+v, want 2 rows and 7 events in the slot", rep.Violations.Unpublished)
	}
}

// A time bound is, in each partition, the first record whose timestamp is
// at or after it: records produced a minute apart are checked from the
// --from's minute up to (not with) the --to's.
func TestVerifyTimeRangeResolvesWithKafkasTimeIndex(t *testing.T) {
	d := deploy(t, 20) // partitions 0 and 1, offsets 0-9 each, produced now
	// After the records produced now, and within the hour ahead that
	// Apache Kafka 4 accepts (log.message.timestamp.after.max.ms).
	base := time.Now().Add(2 * time.Minute).Truncate(time.Minute)
	msgs := make([]kafka.Message, 10)
	for i := range msgs {
		msgs[i] = kafka.Message{Partition: 0, Key: []byte("t"), Value: []byte(fmt.Sprint("timed-", i)), Time: base.Add(time.Duration(i) * time.Minute)}
	}
	d.kafka.Produce(t, d.topic, msgs...) // offsets 10-19 of partition 0
	stop := d.start()
	waitFor(t, "the timed records handled", func() bool {
		var n int
		return d.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kfn.inbox`).Scan(&n) == nil && n == 30
	})
	stop()
	// Lost effects at the first record of each bound's minute.
	d.exec(t, `DELETE FROM effects WHERE source_partition = 0 AND source_offset IN (13, 17)`)
	for _, tc := range []struct {
		name     string
		from, to verify.Bound
		checked  string
		lost     int64
	}{
		{"minutes 3 to 7", verify.TimeBound(base.Add(3 * time.Minute)), verify.TimeBound(base.Add(7 * time.Minute)), "0:[13,17) 1:[10,10)", 1},
		{"from half past minute 2 on", verify.TimeBound(base.Add(150 * time.Second)), verify.Bound{}, "0:[13,20) 1:[10,10)", 2},
		{"up to minute 3", verify.Bound{}, verify.TimeBound(base.Add(3 * time.Minute)), "0:[0,13) 1:[0,10)", 0},
		{"from offset 12 to minute 7", verify.OffsetBound(12), verify.TimeBound(base.Add(7 * time.Minute)), "0:[12,17) 1:[12,12)", 1},
	} {
		spec := d.spec
		spec.From, spec.To = tc.from, tc.to
		rep := d.check(t, spec)
		var want map[string]int64
		if tc.lost > 0 {
			want = map[string]int64{"lost": tc.lost}
		}
		if bad := found(rep, want, map[string][]string{"lost": {}}); bad != "" || rangeOf(rep) != tc.checked {
			t.Errorf("%s: %s; checked %s, want %s", tc.name, bad, rangeOf(rep), tc.checked)
		}
		if tc.from.String() != rep.Cut.Range.From || tc.to.String() != rep.Cut.Range.To {
			t.Errorf("%s: the cut's range %+v, want from %q to %q", tc.name, rep.Cut.Range, tc.from, tc.to)
		}
	}
}

// A range that cannot be checked is refused with a SpecError naming its
// flag, saying what to give instead.
func TestVerifyRefusesABadRange(t *testing.T) {
	d := deploy(t, 20) // partitions 0 and 1, offsets 0-9 each
	ctx := context.Background()
	at := time.Date(2026, 12, 5, 3, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name       string
		change     func(*verify.Spec)
		flag, want string
	}{
		{"from above to", func(s *verify.Spec) { s.From, s.To = verify.OffsetBound(10), verify.OffsetBound(5) },
			"from", "--from: 10 is not below --to 5: the range [from, to) would be empty"},
		{"from equal to", func(s *verify.Spec) { s.From, s.To = verify.OffsetBound(5), verify.OffsetBound(5) },
			"from", "--from: 5 is not below --to 5"},
		{"times crossed", func(s *verify.Spec) { s.From, s.To = verify.TimeBound(at), verify.TimeBound(at.Add(-time.Hour)) },
			"from", "--from: 2026-12-05T03:00:00Z is not before --to 2026-12-05T02:00:00Z"},
		{"a partition the topic does not have", func(s *verify.Spec) { s.Partitions = []int32{0, 7} },
			"partitions", "--partitions: topic " + d.topic + " has no partition 7: its partitions are 0-1"},
		{"a range above what Kafka holds", func(s *verify.Spec) { s.From = verify.OffsetBound(500) },
			"from", "--from: the range holds no record of " + d.topic + " that Kafka holds: Kafka holds partition 0 offsets [0, 10), partition 1 offsets [0, 10)"},
		{"a time after every record", func(s *verify.Spec) { s.Partitions, s.From = []int32{1}, verify.TimeBound(time.Now().Add(time.Hour)) },
			"from", "--from: the range holds no record of " + d.topic + " that Kafka holds: Kafka holds partition 1 offsets [0, 10) (the range there: offsets [10, end))"},
		{"an offset bound and a time that cross", func(s *verify.Spec) {
			s.Partitions, s.From, s.To = []int32{1}, verify.OffsetBound(5), verify.TimeBound(time.Now().Add(-time.Hour))
		}, "from", "--from: the range holds no record of " + d.topic + " that Kafka holds: Kafka holds partition 1 offsets [0, 10) (the range there: offsets [5, 0))"},
		{"a counting shape", func(s *verify.Spec) { s.EffectsSQL, s.Partitions = perKey, []int32{0} },
			"effects-sql", "--effects-sql: the query returns counts, which cannot be compared over a range (--partitions, --from, --to): return one row per applied record (source_topic, source_partition, source_offset)"},
		{"the total shape", func(s *verify.Spec) { s.EffectsSQL, s.To = `SELECT sum(revisions) FROM counts`, verify.OffsetBound(3) },
			"effects-sql", "--effects-sql: the query returns counts, which cannot be compared over a range"},
	} {
		spec := d.spec
		tc.change(&spec)
		_, err := verify.Run(ctx, d.db.Pool, d.js, spec)
		var bad *verify.SpecError
		if !errors.As(err, &bad) || bad.Flag != tc.flag || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("%s: %v; want a SpecError of --%s starting %q", tc.name, err, tc.flag, tc.want)
		}
	}
	t.Run("a NATS-triggered function", func(t *testing.T) {
		d.exec(t, `INSERT INTO kfn.subject_lanes (consumer, subject, lanes, changed_at) VALUES ($1, $2, 1, now())`, function, d.topic)
		defer d.exec(t, `DELETE FROM kfn.subject_lanes`)
		spec := d.spec
		spec.EffectsSQL, spec.From = "", verify.OffsetBound(3)
		_, err := verify.Run(ctx, d.db.Pool, d.js, spec)
		want := fmt.Sprintf("--from: a range applies to Kafka-sourced functions: %s is the NATS subject of %q, a NATS-triggered function, which is checked whole; leave out --partitions, --from and --to", d.topic, function)
		if err == nil || err.Error() != want {
			t.Errorf("a range of a NATS-triggered function: %v; want %q", err, want)
		}
	})
}

// ParseBound and ParsePartitions read kfn verify's --from, --to and
// --partitions, and refuse what is none of their forms.
func TestParseRange(t *testing.T) {
	now := time.Date(2026, 12, 5, 4, 0, 0, 0, time.UTC)
	for in, want := range map[string]string{
		"1200000": "1200000", "0": "0", "2026-12-05T03:00:00Z": "2026-12-05T03:00:00Z",
		"2026-12-05T05:30:00+02:00": "2026-12-05T03:30:00Z", "1h": "2026-12-05T03:00:00Z", "90m": "2026-12-05T02:30:00Z", "": "",
	} {
		b, err := verify.ParseBound("from", in, now)
		if err != nil || b.String() != want {
			t.Errorf("ParseBound(%q) = %q, %v; want %q", in, b, err, want)
		}
	}
	for in, want := range map[string]string{
		"abc":        `--to: "abc" is neither an offset (1200000), an RFC 3339 time (2026-12-05T03:00:00Z) nor an age (1h: an hour ago)`,
		"-3":         "--to: offset -3 is negative: give an offset from 0, an RFC 3339 time or an age such as 1h",
		"-1h":        "--to: age -1h is not positive: give an age such as 1h (from an hour ago)",
		"2026-13-01": `--to: "2026-13-01" is neither an offset`,
	} {
		_, err := verify.ParseBound("to", in, now)
		var bad *verify.SpecError
		if !errors.As(err, &bad) || bad.Flag != "to" || !strings.HasPrefix(err.Error(), want) {
			t.Errorf("ParseBound(%q): %v; want %q", in, err, want)
		}
	}
	if got, err := verify.ParsePartitions(" 7,0, 3,3 "); err != nil || !slices.Equal(got, []int32{0, 3, 7}) {
		t.Errorf("ParsePartitions: %v, %v; want [0 3 7]", got, err)
	}
	if got, err := verify.ParsePartitions(""); err != nil || got != nil {
		t.Errorf("ParsePartitions(\"\"): %v, %v; want none (all)", got, err)
	}
	for _, in := range []string{"1,x", "-1", "3000000000"} {
		_, err := verify.ParsePartitions(in)
		if err == nil || !strings.HasPrefix(err.Error(), "--partitions: ") || !strings.Contains(err.Error(), "is not a partition id: give ids from 0, separated by commas (0,3,7)") {
			t.Errorf("ParsePartitions(%q): %v; want a --partitions error", in, err)
		}
	}
}
