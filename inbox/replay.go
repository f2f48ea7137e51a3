package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// ReplayRequest says where to move a partition's cursor and how.
type ReplayRequest struct {
	Partition Partition
	Token     int64 // the replayer's fencing token; it must hold the partition
	From      int64 // the offset to resume at
	ReplayOptions
	// KafkaFirst is the first offset Kafka still holds in the partition
	// (0 if unknown): no inbox row is expected below it.
	KafkaFirst int64
}

// ReplayOptions are what an operator asks of a replay besides where it
// starts: how far, whether handled records are applied again, and who
// asks and why. The operator's replay (operator.ReplaySpec) takes them as
// they are.
type ReplayOptions struct {
	// To ends the replayed range [From, To); 0 means the cursor's
	// high-water mark. A re-execution applies the records in [From, To)
	// again; the handled records from To on keep their inbox rows and are
	// skipped (a row purged by retention is written back first, see
	// ReplayPlan.InboxRestore). An idempotent replay skips every handled
	// record anyway, so there To only bounds what the plan counts.
	To int64
	// Reexecute applies records again even though they were handled: their
	// inbox rows in [From, To) are deleted, the high-water mark drops to
	// From and, unless KeepEventIDs, the generation grows, so the events
	// they emit get new ids. Without it the replay is idempotent: handled
	// records are read and skipped.
	Reexecute bool
	// KeepEventIDs keeps the generation of a re-execution, so the
	// re-executed records emit the ids of the events they emitted before
	// and downstream (JetStream's duplicate window, the downstream inboxes)
	// drops the events it already handled. It is refused when a record of
	// the range was last executed under an older generation, whose ids
	// kfn would not reproduce, and while an event of the range waits in
	// the outbox (the same id would collide with it).
	KeepEventIDs bool
	Actor        string // who asked, for the audit log
	Reason       string // why; required for a re-execution
}

// ReplayPlan is what a replay would do to one partition, computed without
// changing anything (PlanReplay) and again, under the partition's lock, by
// Replay itself.
type ReplayPlan struct {
	Partition Partition
	Cursor    Cursor // as read
	From, To  int64
	// Offsets is To - From; KafkaHolds of them are at or above KafkaFirst.
	Offsets, KafkaHolds int64
	// Handled offsets of the range are below the high-water mark: all of
	// them, as To never passes it. InboxApplied and InboxDeadLettered count
	// the inbox rows of the range; the other handled offsets have no row
	// any more (purged by retention, a gap of a compacted topic, records
	// Kafka deleted before they were read).
	Handled, InboxApplied, InboxDeadLettered int64
	// Reexecute is how many offsets a re-execution applies again (0 for an
	// idempotent replay), and Skipped how many handled offsets after To
	// stay handled: their inbox rows keep them from being applied again.
	Reexecute, Skipped int64
	// InboxRestore counts the offsets of [To, high-water mark) that have no
	// inbox row; a bounded re-execution writes one for each, so that the
	// records there stay skipped when the high-water mark drops to From.
	InboxRestore int64
	// Generation is the partition's generation now and NewGeneration the
	// one the re-executed records emit their events under.
	Generation, NewGeneration int
	// PendingOutbox counts events emitted by records of the range that are
	// still in the outbox, not yet relayed.
	PendingOutbox int64
}

// NewEventIDs reports whether the re-executed records emit events with
// ids downstream has not seen.
func (p ReplayPlan) NewEventIDs() bool { return p.NewGeneration != p.Generation }

// ReplayResult describes what a replay changed.
type ReplayResult struct {
	Plan          ReplayPlan
	Previous      Cursor
	Now           Cursor
	InboxReleased int64 // inbox rows deleted by a re-execution
	InboxRestored int64 // inbox rows written back for [To, high-water mark)
}

// ErrReplayPastHighWater means the requested offset is beyond every handled
// record: moving there would skip records that were never handled.
var ErrReplayPastHighWater = errors.New("cannot move the cursor past records that were never handled")

// ErrReplayRange means the range to replay is empty or reversed.
var ErrReplayRange = errors.New("the range to replay is empty")

// ErrInboxPurged means a re-execution would cover records whose inbox rows
// retention purged: kfn no longer knows how each of them ended.
var ErrInboxPurged = errors.New("the inbox rows of the range were purged by retention")

// ErrEventIDsNotKept means --keep-event-ids cannot give the range's records
// the ids of the events they emitted before.
var ErrEventIDsNotKept = errors.New("the original event ids cannot be kept")

// PlanReplay validates r against the cursor cur and counts what the
// replay would do, reading through db and changing nothing. Replay calls
// it under the cursor's row lock; an operator's dry run calls it as is.
func PlanReplay(ctx context.Context, db Querier, r ReplayRequest, cur Cursor) (ReplayPlan, error) {
	p := r.Partition
	plan := ReplayPlan{Partition: p, Cursor: cur, From: r.From, To: r.To, Generation: cur.Generation, NewGeneration: cur.Generation}
	if r.From < 0 || r.From > cur.HighWater {
		return plan, fmt.Errorf("%w: offset %d is outside [0, %d] of %s (every offset below the high-water mark %d was handled; the worker reaches the others on its own)",
			ErrReplayPastHighWater, r.From, cur.HighWater, p, cur.HighWater)
	}
	if plan.To <= 0 {
		plan.To = cur.HighWater
	} else {
		if plan.To <= r.From {
			return plan, fmt.Errorf("%w: --to-offset %d is not after the from offset %d of %s", ErrReplayRange, plan.To, r.From, p)
		}
		if plan.To > cur.HighWater {
			return plan, fmt.Errorf("%w: --to-offset %d is past the high-water mark %d of %s: the records from %d on were never handled, and the worker applies them for the first time anyway",
				ErrReplayPastHighWater, plan.To, cur.HighWater, p, cur.HighWater)
		}
	}
	if r.KeepEventIDs && !r.Reexecute {
		return plan, errors.New("keeping event ids is a choice of a re-execution: an idempotent replay emits no events")
	}
	plan.Offsets = plan.To - plan.From
	plan.KafkaHolds = plan.To - max(plan.From, min(r.KafkaFirst, plan.To))
	plan.Handled = plan.Offsets
	err := db.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE outcome = 'applied'), count(*) FILTER (WHERE outcome = 'dead_lettered')
  FROM kfn.inbox WHERE lane = `+laneSQL+` AND "offset" >= $4 AND "offset" < $5`,
		p.Consumer, p.Topic, p.Partition, plan.From, plan.To).Scan(&plan.InboxApplied, &plan.InboxDeadLettered)
	if err != nil {
		return plan, fmt.Errorf("count the inbox rows of %s in [%d, %d): %w", p, plan.From, plan.To, err)
	}
	if !r.Reexecute {
		return plan, nil
	}
	if plan.Offsets == 0 {
		return plan, fmt.Errorf("%w: nothing to re-execute in [%d, %d) of %s", ErrReplayRange, plan.From, plan.To, p)
	}
	plan.Reexecute = plan.Offsets
	plan.Skipped = cur.HighWater - plan.To
	if err := checkInboxKept(ctx, db, r, plan); err != nil {
		return plan, err
	}
	if plan.Skipped > 0 {
		var rows int64
		err := db.QueryRow(ctx, `SELECT count(*) FROM kfn.inbox WHERE lane = `+laneSQL+` AND "offset" >= $4 AND "offset" < $5`,
			p.Consumer, p.Topic, p.Partition, plan.To, cur.HighWater).Scan(&rows)
		if err != nil {
			return plan, fmt.Errorf("count the inbox rows of %s in [%d, %d): %w", p, plan.To, cur.HighWater, err)
		}
		plan.InboxRestore = plan.Skipped - rows
	}
	err = db.QueryRow(ctx, `SELECT count(*) FROM kfn.outbox WHERE source = $1 AND source_topic = $2 AND source_partition = $3 AND source_offset >= $4 AND source_offset < $5`,
		p.Consumer, p.Topic, p.Partition, plan.From, plan.To).Scan(&plan.PendingOutbox)
	if err != nil {
		return plan, fmt.Errorf("count the outbox rows of %s in [%d, %d): %w", p, plan.From, plan.To, err)
	}
	if !r.KeepEventIDs {
		plan.NewGeneration = cur.Generation + 1
		return plan, nil
	}
	if plan.PendingOutbox > 0 {
		return plan, fmt.Errorf("%w: %d events emitted by records of [%d, %d) of %s are still in the outbox, not relayed yet; re-executed with the same ids they would collide with them (is the relay running?). Wait until the relay has published them",
			ErrEventIDsNotKept, plan.PendingOutbox, plan.From, plan.To, p)
	}
	return plan, checkGeneration(ctx, db, p, plan)
}

// checkInboxKept refuses a re-execution over records whose inbox rows were
// purged by retention: the rows of a partition are purged oldest first, so
// an offset of the range that Kafka still holds but that lies below the
// partition's oldest inbox row lost its row.
func checkInboxKept(ctx context.Context, db Querier, r ReplayRequest, plan ReplayPlan) error {
	p := r.Partition
	lo := max(plan.From, r.KafkaFirst)
	if lo >= plan.To {
		return nil // Kafka no longer holds any of it: nothing there to re-execute, nothing to know
	}
	var oldest *int64
	err := db.QueryRow(ctx, `SELECT min("offset") FROM kfn.inbox WHERE lane = `+laneSQL,
		p.Consumer, p.Topic, p.Partition).Scan(&oldest)
	if err != nil {
		return fmt.Errorf("read the oldest inbox row of %s: %w", p, err)
	}
	switch {
	case oldest == nil:
		return fmt.Errorf("%w: %s has no inbox row left, yet offsets [%d, %d) were handled: retention (--inbox-retention) purged them, and kfn no longer knows which records were applied and which dead-lettered. Re-executing them is refused",
			ErrInboxPurged, p, lo, plan.To)
	case *oldest > lo:
		return fmt.Errorf("%w: the oldest inbox row of %s is at offset %d, so the rows of [%d, %d) were purged by retention (--inbox-retention) and kfn no longer knows which of those records were applied and which dead-lettered. Re-execute from %d or later",
			ErrInboxPurged, p, *oldest, lo, min(*oldest, plan.To), *oldest)
	}
	return nil
}

// checkGeneration refuses to keep the event ids of a range whose records
// were not all last executed under the partition's current generation. The
// records executed under it are those the re-execution that set it covered
// ([from, to), or [from, ∞) before re-executions had an end) and those it
// found unhandled (from its previous high-water mark on); the others
// emitted their events under an older generation, which kfn does not keep
// per record.
func checkGeneration(ctx context.Context, db Querier, p Partition, plan ReplayPlan) error {
	if plan.Generation == 0 {
		return nil // every record ever executed here emitted under generation 0
	}
	var details []byte
	err := db.QueryRow(ctx, `
SELECT details FROM kfn.audit_log
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND action = 'reexecute'
   AND coalesce((details->>'keep_event_ids')::boolean, false) = false
 ORDER BY id DESC LIMIT 1`, p.Consumer, p.Topic, p.Partition).Scan(&details)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: %s is at generation %d but its audit log holds no re-execution that set it, so kfn cannot tell which records emitted under it",
			ErrEventIDsNotKept, p, plan.Generation)
	}
	if err != nil {
		return fmt.Errorf("read the re-executions of %s: %w", p, err)
	}
	var last struct {
		From              int64  `json:"from"`
		To                *int64 `json:"to"`
		PreviousHighWater int64  `json:"previous_high_water"`
	}
	if err := json.Unmarshal(details, &last); err != nil {
		return fmt.Errorf("read the last re-execution of %s: %w", p, err)
	}
	covered := plan.From >= last.PreviousHighWater || last.To == nil && plan.From >= last.From
	if last.To != nil {
		end := *last.To
		if end >= last.PreviousHighWater {
			end = -1 // [from, to) and [previous high water, ∞) join up
		}
		covered = covered || plan.From >= last.From && (end < 0 || plan.To <= end)
	}
	if !covered {
		return fmt.Errorf("%w: the records of [%d, %d) of %s did not all emit their events under the current generation %d (set by the re-execution from %d); those that emitted under an older one would get new ids anyway. Re-execute a range inside what that re-execution covered, or without --keep-event-ids",
			ErrEventIDsNotKept, plan.From, plan.To, p, plan.Generation, last.From)
	}
	return nil
}

// Replay moves the cursor inside tx and writes the audit log entry.
func Replay(ctx context.Context, tx pgx.Tx, r ReplayRequest) (ReplayResult, error) {
	p := r.Partition
	if r.Reexecute && r.Reason == "" {
		return ReplayResult{}, errors.New("a re-execution needs a reason for the audit log")
	}
	var res ReplayResult
	var err error
	if res.Previous, err = lockOwnedCursor(ctx, tx, p, r.Token); err != nil {
		return ReplayResult{}, err
	}
	if res.Plan, err = PlanReplay(ctx, tx, r, res.Previous); err != nil {
		return ReplayResult{}, err
	}
	plan := res.Plan
	res.Now = res.Previous
	res.Now.NextOffset = r.From
	action := "replay"
	if r.Reexecute {
		action = "reexecute"
		if plan.InboxRestore > 0 {
			// Offsets below the high-water mark were all handled; one that
			// lost its inbox row (retention) must keep being skipped once
			// the high-water mark drops to From.
			tag, err := tx.Exec(ctx, withLane+`
INSERT INTO kfn.inbox (lane, "offset", epoch, outcome)
SELECT (SELECT id FROM lane), o, $4, CASE WHEN EXISTS (SELECT 1 FROM kfn.dead_letters d
                                             WHERE d.consumer = $1 AND d.topic = $2 AND d.partition = $3 AND d."offset" = o)
                               THEN 'dead_lettered'::kfn.outcome ELSE 'applied' END
  FROM generate_series($5::bigint, $6::bigint - 1) AS o
ON CONFLICT DO NOTHING`, p.Consumer, p.Topic, p.Partition, r.Token, plan.To, res.Previous.HighWater)
			if err != nil {
				return ReplayResult{}, fmt.Errorf("write back the inbox rows of %s in [%d, %d): %w", p, plan.To, res.Previous.HighWater, err)
			}
			res.InboxRestored = tag.RowsAffected()
		}
		tag, err := tx.Exec(ctx, `DELETE FROM kfn.inbox WHERE lane = `+laneSQL+` AND "offset" >= $4 AND "offset" < $5`,
			p.Consumer, p.Topic, p.Partition, plan.From, plan.To)
		if err != nil {
			return ReplayResult{}, fmt.Errorf("release inbox rows of %s in [%d, %d): %w", p, plan.From, plan.To, err)
		}
		res.InboxReleased = tag.RowsAffected()
		res.Now.HighWater = r.From
		res.Now.Generation = plan.NewGeneration
	}
	_, err = tx.Exec(ctx, `UPDATE kfn.cursors SET next_offset = $4, high_water = $5, generation = $6, updated_at = now()
 WHERE consumer = $1 AND topic = $2 AND partition = $3`, p.Consumer, p.Topic, p.Partition,
		res.Now.NextOffset, res.Now.HighWater, res.Now.Generation)
	if err != nil {
		return ReplayResult{}, fmt.Errorf("move cursor of %s: %w", p, err)
	}
	details := map[string]any{
		"from": r.From, "previous_next_offset": res.Previous.NextOffset, "previous_high_water": res.Previous.HighWater,
		"epoch": r.Token, "inbox_released": res.InboxReleased, "reason": r.Reason,
	}
	if r.Reexecute {
		details["to"] = plan.To
		details["keep_event_ids"] = r.KeepEventIDs
		details["generation"] = res.Now.Generation
		details["previous_generation"] = res.Previous.Generation
		details["inbox_restored"] = res.InboxRestored
	} else if r.To > 0 {
		details["to"] = plan.To
	}
	if err := writeAudit(ctx, tx, r.Actor, action, p, details); err != nil {
		return ReplayResult{}, err
	}
	return res, nil
}
