package verify

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kfn-dev/kfn/internal/kafkasource"
)

// Bound is one end of a range (Spec.From, Spec.To): an offset, or a time
// that Kafka's time index turns into an offset in each partition. The
// zero Bound is no bound.
type Bound struct {
	offset int64
	at     time.Time
	set    bool
}

// OffsetBound is the bound at offset o of every partition of the range.
func OffsetBound(o int64) Bound { return Bound{offset: o, set: true} }

// TimeBound is the bound at time t: in each partition, the first record
// whose timestamp is at or after t (or the high watermark when none is).
func TimeBound(t time.Time) Bound { return Bound{at: t, set: true} }

// IsZero reports whether b is no bound.
func (b Bound) IsZero() bool { return !b.set }

func (b Bound) isTime() bool { return b.set && !b.at.IsZero() }

// String is the bound as kfn verify takes it: an offset or an RFC 3339
// time; empty for no bound.
func (b Bound) String() string {
	switch {
	case !b.set:
		return ""
	case b.isTime():
		return b.at.UTC().Format(time.RFC3339Nano)
	}
	return strconv.FormatInt(b.offset, 10)
}

// ParseBound reads a bound as kfn verify's --from and --to (flag) take it:
// an offset (1200000), an RFC 3339 time (2026-12-05T03:00:00Z), or an age
// (1h: now minus an hour). Empty is no bound. A value that is none of
// these is a SpecError naming flag.
func ParseBound(flag, s string, now time.Time) (Bound, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return Bound{}, nil
	}
	if o, err := strconv.ParseInt(s, 10, 64); err == nil {
		if o < 0 {
			return Bound{}, specError(flag, "offset %d is negative: give an offset from 0, an RFC 3339 time or an age such as 1h", o)
		}
		return OffsetBound(o), nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return TimeBound(t), nil
	}
	if age, err := time.ParseDuration(s); err == nil {
		if age <= 0 {
			return Bound{}, specError(flag, "age %s is not positive: give an age such as 1h (from an hour ago)", s)
		}
		return TimeBound(now.Add(-age)), nil
	}
	return Bound{}, specError(flag, "%q is neither an offset (1200000), an RFC 3339 time (2026-12-05T03:00:00Z) nor an age (1h: an hour ago)", s)
}

// ParsePartitions reads kfn verify's --partitions: partition ids separated
// by commas (0,3,7), in any order; empty is every partition.
func ParsePartitions(s string) ([]int32, error) {
	var out []int32
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		p, err := strconv.ParseInt(f, 10, 32)
		if err != nil || p < 0 {
			return nil, specError("partitions", "%q is not a partition id: give ids from 0, separated by commas (0,3,7)", f)
		}
		out = append(out, int32(p))
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// ranged reports whether spec asks for a range rather than the whole
// source.
func (spec Spec) ranged() bool {
	return len(spec.Partitions) > 0 || spec.From.set || spec.To.set
}

// rangeFlag names a flag of the range spec gives, for an error.
func (spec Spec) rangeFlag() string {
	switch {
	case len(spec.Partitions) > 0:
		return "partitions"
	case spec.From.set:
		return "from"
	}
	return "to"
}

// checkBounds refuses a range whose bounds are of one kind and do not
// leave room between them.
func (spec Spec) checkBounds() error {
	from, to := spec.From, spec.To
	if !from.set || !to.set || from.isTime() != to.isTime() {
		return nil
	}
	if from.isTime() && !from.at.Before(to.at) {
		return specError("from", "%s is not before --to %s: the range [from, to) would be empty", from, to)
	}
	if !from.isTime() && from.offset >= to.offset {
		return specError("from", "%d is not below --to %d: the range [from, to) would be empty", from.offset, to.offset)
	}
	return nil
}

// span is the offsets [from, to) of one partition that a range asks for,
// before clipping to what Kafka holds and to the cursor.
type span struct{ from, to int64 }

// scope is the part of a Kafka topic a ranged run checks: its partitions
// and their spans. A nil scope is the whole topic.
type scope struct {
	spans map[int32]span
	// parts, froms and tos are the spans as the arrays the Postgres
	// streams filter by.
	parts      []int32
	froms, tos []int64
}

// has reports whether offset o of partition p is in the scope.
func (sc *scope) has(p int32, o int64) bool {
	if sc == nil {
		return true
	}
	s, ok := sc.spans[p]
	return ok && o >= s.from && o < s.to
}

// args are the scope's arrays for a query's filter: three NULLs for the
// whole topic.
func (sc *scope) args() []any {
	if sc == nil {
		return []any{nil, nil, nil}
	}
	return []any{sc.parts, sc.froms, sc.tos}
}

// resolveScope turns spec's range into each selected partition's span,
// asking Kafka's time index for a time bound (an offset and a time may
// cross in a partition: its span is then empty). It refuses a partition
// the topic does not have, and a range where Kafka holds no record. parts
// are the topic's partitions, from readKafkaRanges; nil for no range.
func resolveScope(ctx context.Context, klog *kafkasource.Log, spec Spec, parts []kafkaPartition) (*scope, error) {
	if !spec.ranged() {
		return nil, nil
	}
	var listed []int32
	byID := map[int32]kafkaPartition{}
	for _, p := range parts {
		if p.listed {
			listed = append(listed, p.id)
			byID[p.id] = p
		}
	}
	selected := slices.Compact(slices.Sorted(slices.Values(spec.Partitions))) // a caller's list may repeat an id
	if len(selected) == 0 {
		selected = listed
	}
	for _, id := range selected {
		if _, ok := byID[id]; !ok {
			return nil, specError("partitions", "topic %s has no partition %d: its partitions are %s", spec.Topic, id, partitionList(listed))
		}
	}
	sc := &scope{spans: map[int32]span{}}
	var held []string
	empty := true
	for _, id := range selected {
		p := byID[id]
		from, err := offsetOf(ctx, klog, spec.Topic, p, spec.From, 0)
		if err != nil {
			return nil, err
		}
		to, err := offsetOf(ctx, klog, spec.Topic, p, spec.To, math.MaxInt64)
		if err != nil {
			return nil, err
		}
		sc.spans[id] = span{from: from, to: to}
		sc.parts, sc.froms, sc.tos = append(sc.parts, id), append(sc.froms, from), append(sc.tos, to)
		held = append(held, fmt.Sprintf("partition %d offsets [%d, %d)", id, p.first, p.high))
		if spec.From.isTime() || spec.To.isTime() {
			held[len(held)-1] += fmt.Sprintf(" (the range there: %s)", span{from: from, to: to})
		}
		empty = empty && max(from, p.first) >= min(to, p.high)
	}
	if empty {
		flag := "from"
		if spec.To.set && !spec.From.set {
			flag = "to"
		}
		return nil, specError(flag, "the range holds no record of %s that Kafka holds: Kafka holds %s", spec.Topic, strings.Join(held, ", "))
	}
	return sc, nil
}

// String writes the span as offsets [from, to), "end" for no end.
func (s span) String() string {
	if s.to == math.MaxInt64 {
		return fmt.Sprintf("offsets [%d, end)", s.from)
	}
	return fmt.Sprintf("offsets [%d, %d)", s.from, s.to)
}

// offsetOf is b's offset in partition p: its offset, or for a time the
// first offset whose record's timestamp is at or after it (the high
// watermark when no record is); none when b is no bound.
func offsetOf(ctx context.Context, klog *kafkasource.Log, topic string, p kafkaPartition, b Bound, none int64) (int64, error) {
	switch {
	case !b.set:
		return none, nil
	case !b.isTime():
		return b.offset, nil
	}
	o, found, err := klog.OffsetAt(ctx, topic, p.id, b.at)
	if err != nil {
		return 0, fmt.Errorf("find the offset of %s in %s/%d with Kafka's time index: %w", b, topic, p.id, err)
	}
	if !found {
		return p.high, nil
	}
	return o, nil
}

// partitionList writes ids as 0-3 when they run without a gap, else as a
// list.
func partitionList(ids []int32) string {
	if len(ids) == 0 {
		return "none"
	}
	if int(ids[len(ids)-1]-ids[0]) == len(ids)-1 && len(ids) > 1 {
		return fmt.Sprintf("%d-%d", ids[0], ids[len(ids)-1])
	}
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.Itoa(int(id))
	}
	return strings.Join(s, ",")
}
