package main

import (
	"time"

	"github.com/kfn-dev/kfn/operator"
)

// replayJSON is what kfn replay --json prints, for a dry run (the plan)
// and for a replay (the plan and what it changed); docs/cli-json.md
// documents it.
type replayJSON struct {
	DryRun     bool                  `json:"dry_run"`
	Function   string                `json:"function"`
	Topic      string                `json:"topic"`
	Mode       string                `json:"mode"`                // "idempotent" or "reexecute"
	FromTime   *time.Time            `json:"from_time,omitempty"` // --from-time, resolved
	Partitions []replayPartitionJSON `json:"partitions"`
	// Waited is set with --wait once the workers reached the end of the
	// replay in every partition.
	Waited *replayWaitJSON `json:"waited,omitempty"`
}

// replayPartitionJSON is one partition of a replay.
type replayPartitionJSON struct {
	Partition int32 `json:"partition"`
	// LeftAlone says why nothing is replayed here (--from-time at or
	// after the cursor); the plan's other fields are then as read.
	LeftAlone string `json:"left_alone,omitempty"`
	Cursor    int64  `json:"cursor"`     // the cursor before
	HighWater int64  `json:"high_water"` // the high-water mark before
	From      int64  `json:"from"`       // the cursor after
	To        int64  `json:"to"`         // the end of the range, exclusive
	// TimeOffset is the offset --from-time resolved to, -1 when no record
	// is that recent; absent without --from-time.
	TimeOffset        *int64 `json:"time_offset,omitempty"`
	Offsets           int64  `json:"offsets"`
	KafkaHolds        int64  `json:"kafka_holds"`
	KafkaFirst        int64  `json:"kafka_first"` // -1: not asked
	KafkaHigh         int64  `json:"kafka_high"`  // -1: not asked
	Handled           int64  `json:"handled"`
	InboxApplied      int64  `json:"inbox_applied"`
	InboxDeadLettered int64  `json:"inbox_dead_lettered"`
	Reexecute         int64  `json:"reexecute"`
	Skipped           int64  `json:"skipped"`
	InboxRestore      int64  `json:"inbox_restore"`
	Generation        int    `json:"generation"`
	NewGeneration     int    `json:"new_generation"`
	NewEventIDs       bool   `json:"new_event_ids"`
	PendingOutbox     int64  `json:"pending_outbox"`
	// Result is what the replay changed; absent in a dry run and for a
	// partition left alone.
	Result *replayResultJSON `json:"result,omitempty"`
}

// replayResultJSON is what a replay changed in one partition.
type replayResultJSON struct {
	PreviousCursor    int64 `json:"previous_cursor"`
	PreviousHighWater int64 `json:"previous_high_water"`
	Cursor            int64 `json:"cursor"`
	HighWater         int64 `json:"high_water"`
	Generation        int   `json:"generation"`
	Epoch             int64 `json:"epoch"`
	InboxReleased     int64 `json:"inbox_released"`
	InboxRestored     int64 `json:"inbox_restored"`
}

// replayWaitJSON is what kfn replay --wait --json adds.
type replayWaitJSON struct {
	Partitions int    `json:"partitions"`
	After      string `json:"after"` // a duration, as Go prints it
}

// replayJSONOf is the JSON of a replay or its dry run.
func replayJSONOf(spec operator.ReplaySpec, replays []operator.PartitionReplay) replayJSON {
	out := replayJSON{DryRun: spec.DryRun, Function: spec.Function, Topic: spec.Topic, Mode: "idempotent", Partitions: []replayPartitionJSON{}}
	if spec.Reexecute {
		out.Mode = "reexecute"
	}
	if !spec.FromTime.IsZero() {
		t := spec.FromTime.UTC()
		out.FromTime = &t
	}
	for _, pr := range replays {
		p := pr.Plan
		row := replayPartitionJSON{
			Partition: p.Partition.Partition, LeftAlone: pr.Nothing,
			Cursor: p.Cursor.NextOffset, HighWater: p.Cursor.HighWater, From: p.From, To: p.To,
			Offsets: p.Offsets, KafkaHolds: p.KafkaHolds, KafkaFirst: pr.KafkaFirst, KafkaHigh: pr.KafkaHigh,
			Handled: p.Handled, InboxApplied: p.InboxApplied, InboxDeadLettered: p.InboxDeadLettered,
			Reexecute: p.Reexecute, Skipped: p.Skipped, InboxRestore: p.InboxRestore,
			Generation: p.Generation, NewGeneration: p.NewGeneration, NewEventIDs: p.NewEventIDs(), PendingOutbox: p.PendingOutbox,
		}
		if !spec.FromTime.IsZero() {
			off := pr.TimeOffset
			row.TimeOffset = &off
		}
		if r := pr.Result; r != nil {
			row.Result = &replayResultJSON{
				PreviousCursor: r.Previous.NextOffset, PreviousHighWater: r.Previous.HighWater,
				Cursor: r.Now.NextOffset, HighWater: r.Now.HighWater, Generation: r.Now.Generation, Epoch: r.Now.Epoch,
				InboxReleased: r.InboxReleased, InboxRestored: r.InboxRestored,
			}
		}
		out.Partitions = append(out.Partitions, row)
	}
	return out
}
