package kafkasource

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/settings"
)

// mirrorMetadata is the metadata of every offset kfn mirrors: it tells
// kfn's offsets from those of another consumer using a group of the same
// name.
const mirrorMetadata = "kfn-mirror"

const (
	// mirrorWarnEvery is how often, at most, a failing mirror is logged at
	// WARN per group and topic; the failures held back meanwhile are counted
	// in the next warning.
	mirrorWarnEvery = 30 * time.Second
	// groupRecheckEvery is how often a group found to be another
	// consumer's is looked at again (it may have been deleted since).
	groupRecheckEvery = time.Minute
)

// GroupMirror mirrors committed cursors into the Kafka consumer group,
// asynchronously and best effort, so standard lag tools see progress. The
// worker never reads these offsets back: Postgres holds the truth. Before
// its first commit to a group it checks that the group is not another
// consumer's (see groupUser), and never writes to one that is.
type GroupMirror struct {
	source *Source
	log    *slog.Logger
	warn   *warnLimiter
	now    func() time.Time

	mu       sync.Mutex
	pending  map[groupTopic]map[int]int64
	failures int64 // commits that failed, for kfn_offset_mirror_failures_total

	// groups is what flush knows of each group. Only flush writes it, under
	// mu (the metrics read it).
	groups map[string]*groupCheck
}

// groupTopic is a consumer group and a topic.
type groupTopic struct{ group, topic string }

// groupCheck is what the committer knows of a group: kfn's to mirror to,
// or another consumer's (refused, why) until checkAfter.
type groupCheck struct {
	ours       bool
	refused    string
	checkAfter time.Time
}

func NewGroupMirror(source *Source, log *slog.Logger) *GroupMirror {
	return &GroupMirror{
		source: source, log: log, warn: newWarnLimiter(mirrorWarnEvery, time.Now), now: time.Now,
		pending: map[groupTopic]map[int]int64{}, groups: map[string]*groupCheck{},
	}
}

// note records that everything below next is committed in Postgres.
func (c *GroupMirror) Note(group, topic string, partition int32, next int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := groupTopic{group, topic}
	if c.pending[k] == nil {
		c.pending[k] = map[int]int64{}
	}
	c.pending[k][int(partition)] = next
}

// run flushes noted offsets every interval until ctx ends, then once more.
func (c *GroupMirror) Run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			flushCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			c.flush(flushCtx)
			cancel()
			return
		case <-t.C:
			c.flush(ctx)
		}
	}
}

// errGroupNotChecked keeps the offsets of a group kfn may not write to
// (yet) pending.
var errGroupNotChecked = errors.New("the consumer group is not known to be kfn's")

func (c *GroupMirror) flush(ctx context.Context) {
	c.mu.Lock()
	batch := c.pending
	c.pending = map[groupTopic]map[int]int64{}
	c.mu.Unlock()
	for k, parts := range batch {
		if !c.mayMirror(ctx, k) {
			c.requeue(k, parts, errGroupNotChecked)
			continue
		}
		commits := make([]kafka.OffsetCommit, 0, len(parts))
		for p, off := range parts {
			commits = append(commits, kafka.OffsetCommit{Partition: p, Offset: off, Metadata: mirrorMetadata})
		}
		resp, err := c.source.client.OffsetCommit(ctx, &kafka.OffsetCommitRequest{
			GroupID: k.group, GenerationID: -1, Topics: map[string][]kafka.OffsetCommit{k.topic: commits},
		})
		failed := parts
		if err == nil {
			// The request went through; some partitions may still have failed
			// (a coordinator still loading the group, say).
			failed = map[int]int64{}
			for _, pr := range resp.Topics[k.topic] {
				if pr.Error != nil {
					failed[pr.Partition] = parts[pr.Partition]
					err = pr.Error
				}
			}
		}
		if err != nil && !isShutdown(ctx, err) {
			c.mu.Lock()
			c.failures++
			c.mu.Unlock()
			if ok, held := c.warn.allow("commit\x00" + k.group + "\x00" + k.topic); ok {
				c.log.Warn("mirror offsets to Kafka consumer group failed (best effort, for lag tools only; retried at the next flush)",
					"group", k.group, "topic", k.topic, "partitions", slices.Sorted(maps.Keys(failed)), "err", err,
					"suppressed", held, "warn_every", mirrorWarnEvery)
			}
		}
		c.requeue(k, failed, err)
	}
}

// mayMirror says whether k's group may be written to, checking it first if
// that is due.
func (c *GroupMirror) mayMirror(ctx context.Context, k groupTopic) bool {
	st := c.groups[k.group]
	if st == nil {
		st = &groupCheck{}
		c.mu.Lock()
		c.groups[k.group] = st
		c.mu.Unlock()
	}
	if st.ours {
		return true
	}
	if c.now().Before(st.checkAfter) {
		return false
	}
	why, err := c.source.groupUser(ctx, k.group)
	if err != nil {
		if ok, held := c.warn.allow("check\x00" + k.group); ok && !isShutdown(ctx, err) {
			c.log.Warn("cannot check that the Kafka consumer group is kfn's: offsets are not mirrored to it until it is (retried at the next flush)",
				"group", k.group, "err", err, "suppressed", held, "warn_every", mirrorWarnEvery)
		}
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if why != "" {
		st.checkAfter = c.now().Add(groupRecheckEvery)
		if why != st.refused {
			c.log.Warn(fmt.Sprintf("Kafka consumer group %q is not kfn's: %s. kfn does not mirror its offsets there, so lag tools do not see this function's progress; set --consumer-group (%s) to a group of kfn's own, or delete the group if it is a leftover (kfn looks again every %s)",
				k.group, why, settings.ConsumerGroup.Env, groupRecheckEvery), "group", k.group, "topic", k.topic)
		}
		st.refused = why
		return false
	}
	if st.refused != "" {
		c.log.Info("Kafka consumer group is free now: mirroring offsets to it", "group", k.group)
	}
	st.ours, st.refused = true, ""
	return true
}

// State returns, for kfn_consumer_group_refused, each group checked
// so far and whether it was refused as another consumer's, and the count of
// failed commits.
func (c *GroupMirror) State() (refused map[string]bool, failures int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	refused = map[string]bool{}
	for g, st := range c.groups {
		refused[g] = st.refused != ""
	}
	return refused, c.failures
}

// requeue puts back the offsets of a commit that failed, unless a newer
// offset was noted for the partition meanwhile: after the last record of a
// partition nothing else would commit it again.
func (c *GroupMirror) requeue(k groupTopic, failed map[int]int64, err error) {
	if err == nil || len(failed) == 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pending[k] == nil {
		c.pending[k] = map[int]int64{}
	}
	for p, off := range failed {
		if cur, ok := c.pending[k][p]; !ok || cur < off {
			c.pending[k][p] = off
		}
	}
}

// groupUser says why group is another consumer's, or "" when kfn may
// mirror to it: the group has members (kfn never joins a group), or it has
// an offset committed without kfn's metadata (by a consumer, an admin
// tool, or a kfn release older than the metadata).
func (k *Source) groupUser(ctx context.Context, group string) (string, error) {
	d, err := k.client.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
	if err != nil {
		return "", fmt.Errorf("describe consumer group %s: %w", group, kafkaconn.Explain(err, k.brokers, k.security))
	}
	for _, g := range d.Groups {
		switch {
		case g.Error != nil && !errors.Is(g.Error, kafka.GroupIdNotFound):
			return "", fmt.Errorf("describe consumer group %s: %w", group, g.Error)
		case len(g.Members) > 0:
			return fmt.Sprintf("it has %d active members (client %q; group state %s)", len(g.Members), g.Members[0].ClientID, g.GroupState), nil
		}
	}
	o, err := k.client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group}) // no topics: all of them
	if err != nil {
		return "", fmt.Errorf("read the offsets of consumer group %s: %w", group, kafkaconn.Explain(err, k.brokers, k.security))
	}
	if errors.Is(o.Error, kafka.GroupIdNotFound) {
		return "", nil // no offsets at all (the embedded broker answers so)
	} else if o.Error != nil {
		return "", fmt.Errorf("read the offsets of consumer group %s: %w", group, o.Error)
	}
	topics := slices.Sorted(maps.Keys(o.Topics))
	for _, topic := range topics {
		parts := o.Topics[topic]
		sort.Slice(parts, func(i, j int) bool { return parts[i].Partition < parts[j].Partition })
		for _, p := range parts {
			if p.Error == nil && p.CommittedOffset >= 0 && p.Metadata != mirrorMetadata {
				return fmt.Sprintf("partition %s/%d has offset %d committed by another consumer (metadata %q; kfn writes %q)",
					topic, p.Partition, p.CommittedOffset, p.Metadata, mirrorMetadata), nil
			}
		}
	}
	return "", nil
}

// warnLimiter lets a repeated warning through at most once per interval
// per key, and counts the ones it held back.
type warnLimiter struct {
	every time.Duration
	now   func() time.Time

	mu   sync.Mutex
	last map[string]time.Time
	held map[string]int
}

func newWarnLimiter(every time.Duration, now func() time.Time) *warnLimiter {
	return &warnLimiter{every: every, now: now, last: map[string]time.Time{}, held: map[string]int{}}
}

// allow reports whether the warning keyed key may be logged now and, if
// so, how many were held back since the last one logged.
func (l *warnLimiter) allow(key string) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	if last, ok := l.last[key]; ok && now.Sub(last) < l.every {
		l.held[key]++
		return false, 0
	}
	held := l.held[key]
	delete(l.held, key)
	l.last[key] = now
	return true, held
}

func isShutdown(ctx context.Context, err error) bool {
	return ctx.Err() != nil || errors.Is(err, context.Canceled)
}
