package inbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// ReplayRequest says where to move a partition's cursor and how.
type ReplayRequest struct {
	Partition Partition
	Token     int64 // the replayer's fencing token; it must hold the partition
	From      int64 // the offset to resume at
	// Reexecute applies records again even though they were handled: their
	// inbox rows are deleted, the high-water mark drops to From and the
	// generation grows, so the events they emit get new ids. Without it the
	// replay is idempotent: handled records are read and skipped.
	Reexecute bool
	Actor     string // who asked, for the audit log
	Reason    string // why; required for a re-execution
}

// ReplayResult describes what a replay changed.
type ReplayResult struct {
	Previous      Cursor
	Now           Cursor
	InboxReleased int64 // inbox rows deleted by a re-execution
}

// ErrReplayPastHighWater means the requested offset is beyond every handled
// record: moving there would skip records that were never handled.
var ErrReplayPastHighWater = errors.New("cannot move the cursor past records that were never handled")

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
	if r.From < 0 || r.From > res.Previous.HighWater {
		return ReplayResult{}, fmt.Errorf("%w: offset %d is outside [0, %d] of %s", ErrReplayPastHighWater, r.From, res.Previous.HighWater, p)
	}
	res.Now = res.Previous
	res.Now.NextOffset = r.From
	action := "replay"
	if r.Reexecute {
		action = "reexecute"
		tag, err := tx.Exec(ctx, `DELETE FROM kfn.inbox WHERE consumer = $1 AND topic = $2 AND partition = $3 AND "offset" >= $4`,
			p.Consumer, p.Topic, p.Partition, r.From)
		if err != nil {
			return ReplayResult{}, fmt.Errorf("release inbox rows of %s from %d: %w", p, r.From, err)
		}
		res.InboxReleased = tag.RowsAffected()
		res.Now.HighWater = r.From
		res.Now.Generation++
	}
	_, err = tx.Exec(ctx, `UPDATE kfn.cursors SET next_offset = $4, high_water = $5, generation = $6, updated_at = now()
 WHERE consumer = $1 AND topic = $2 AND partition = $3`, p.Consumer, p.Topic, p.Partition,
		res.Now.NextOffset, res.Now.HighWater, res.Now.Generation)
	if err != nil {
		return ReplayResult{}, fmt.Errorf("move cursor of %s: %w", p, err)
	}
	err = writeAudit(ctx, tx, r.Actor, action, p, map[string]any{
		"from": r.From, "previous_next_offset": res.Previous.NextOffset, "previous_high_water": res.Previous.HighWater,
		"epoch": r.Token, "inbox_released": res.InboxReleased, "reason": r.Reason,
	})
	if err != nil {
		return ReplayResult{}, err
	}
	return res, nil
}
