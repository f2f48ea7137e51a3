package runtime_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// kfn mirrors its offsets to the group --consumer-group names (with its
// metadata), and never to a group of the same name that is another
// consumer's: one with offsets kfn did not write, or with an active member.
// Such a group is left as it was, a WARN names --consumer-group and
// kfn_consumer_group_refused is 1; the function processes its records all
// the same.
func TestConsumerGroupMirrorsToItsOwnGroupOnly(t *testing.T) {
	cases := []struct {
		name string
		// occupy makes group another consumer's before the worker starts.
		occupy func(t *testing.T, b *bundle, group string)
		// foreign is what the WARN says about the group; "" for kfn's own.
		foreign string
	}{
		{name: "new group"},
		{name: "offsets of another consumer", foreign: "committed by another consumer",
			occupy: func(t *testing.T, b *bundle, group string) {
				resp, err := groupClient(b).OffsetCommit(context.Background(), &kafka.OffsetCommitRequest{
					GroupID: group, GenerationID: -1, Topics: map[string][]kafka.OffsetCommit{b.topic: {{Partition: 0, Offset: 1}}},
				})
				if err == nil && resp.Topics[b.topic][0].Error != nil {
					err = resp.Topics[b.topic][0].Error
				}
				if err != nil {
					t.Fatalf("commit the other consumer's offset: %v", err)
				}
			}},
		{name: "active member", foreign: "active members",
			occupy: func(t *testing.T, b *bundle, group string) {
				other := b.kafka.CreateTopic(t, 1)
				r := kafka.NewReader(kafka.ReaderConfig{Brokers: b.kafka.Brokers, GroupID: group, Topic: other, MaxWait: 100 * time.Millisecond,
					HeartbeatInterval: 500 * time.Millisecond, SessionTimeout: 6 * time.Second})
				kfntest.Background(t, "group member", func(ctx context.Context) error {
					defer r.Close()
					_, err := r.FetchMessage(ctx) // joins the group and stays in it until ctx ends
					if ctx.Err() != nil {
						return nil
					}
					return err
				})
				waitFor(t, 30*time.Second, "the other consumer to join "+group, func() bool {
					d, err := groupClient(b).DescribeGroups(context.Background(), &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
					return err == nil && len(d.Groups) == 1 && len(d.Groups[0].Members) > 0
				})
			}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t, 2)
			group := kfntest.Name(t, "group")
			if tc.occupy != nil {
				tc.occupy(t, b, group)
			}
			before := groupOffsets(t, b, group)
			logs := &lockedBuffer{}
			b.cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(testWriter{t}, logs), &slog.HandlerOptions{Level: slog.LevelWarn}))
			b.cfg.ConsumerGroup = group
			w, stop := b.run(t, effects.Function(b.fn, b.topic))
			defer stop()
			srv := httptest.NewServer(w.HTTPHandler())
			defer srv.Close()
			refused := func() float64 {
				v, ok := scrapeMetrics(t, srv.URL+"/metrics").get("kfn_consumer_group_refused", "group", group)
				if !ok {
					return -1
				}
				return v
			}
			for p := range int32(2) {
				b.produce(t, p, []byte("a"), []byte("b"), []byte("c"))
			}
			b.waitCaughtUp(t, b.fn)

			if tc.foreign == "" {
				waitFor(t, 30*time.Second, "the mirrored offsets in "+group, func() bool {
					got := groupOffsets(t, b, group)
					return got["0"] == "3 kfn-mirror" && got["1"] == "3 kfn-mirror"
				})
				if got := groupOffsets(t, b, b.fn); len(got) != 0 {
					t.Errorf("the group named after the function got offsets %v; want none", got)
				}
				if strings.Contains(logs.String(), "is not kfn's") || refused() != 0 {
					t.Errorf("a new group was taken for another consumer's (kfn_consumer_group_refused %v):\n%s", refused(), logs)
				}
				return
			}
			waitFor(t, 30*time.Second, "a WARN that names --consumer-group", func() bool {
				return strings.Contains(logs.String(), "set --consumer-group (KFN_CONSUMER_GROUP) to a group of kfn's own")
			})
			if !strings.Contains(logs.String(), tc.foreign) {
				t.Errorf("the warning does not say %q:\n%s", tc.foreign, logs)
			}
			if v := refused(); v != 1 {
				t.Errorf("kfn_consumer_group_refused = %v, want 1", v)
			}
			time.Sleep(1500 * time.Millisecond) // past the next mirror flush
			if got := groupOffsets(t, b, group); fmt.Sprint(got) != fmt.Sprint(before) {
				t.Errorf("the other consumer's group went from %v to %v; kfn must not write to it", before, got)
			}
		})
	}
}

func groupClient(b *bundle) *kafka.Client {
	return &kafka.Client{Addr: kafka.TCP(b.kafka.Brokers...), Timeout: 10 * time.Second}
}

// groupOffsets returns the committed offsets (with their metadata) of
// group on the test's topic, by partition; none for a group that never
// committed. It retries errors for a while: Kafka answers the first group
// requests on a fresh broker with NOT_COORDINATOR.
func groupOffsets(t *testing.T, b *bundle, group string) map[string]string {
	t.Helper()
	var resp *kafka.OffsetFetchResponse
	var err error
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		resp, err = groupClient(b).OffsetFetch(context.Background(), &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{b.topic: {0, 1}}})
		if err == nil && resp.Error != nil && !errors.Is(resp.Error, kafka.GroupIdNotFound) { // the embedded broker's answer for a group that never committed
			err = resp.Error
		}
		if err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatalf("fetch the offsets of %s: %v", group, err)
	}
	out := map[string]string{}
	for _, p := range resp.Topics[b.topic] {
		if p.Error == nil && p.CommittedOffset >= 0 {
			out[fmt.Sprint(p.Partition)] = fmt.Sprintf("%d %s", p.CommittedOffset, p.Metadata)
		}
	}
	return out
}
