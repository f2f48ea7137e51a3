package inbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// ReasonParked is the dead-letter reason of a record an operator parked.
const ReasonParked = "parked"

// ErrAlreadyHandled means the record to park was applied or dead-lettered
// already; there is nothing to park.
var ErrAlreadyHandled = errors.New("the record was already applied or dead-lettered")

// ParkRequest asks to dead-letter one record that its lane has not handled.
type ParkRequest struct {
	Partition Partition
	Token     int64 // the operator's fencing token; it must hold the partition
	Offset    int64
	// Record holds the record as read from Kafka (key, value, headers,
	// time), or nil when it could not be read.
	Record *DeadLetter
	Actor  string // who asked, for the audit log
	Reason string // why; required
}

// ParkResult describes what a park changed.
type ParkResult struct {
	Previous Cursor
	Now      Cursor
}

// Park is the operator's escape hatch for a record that no one foresaw: it
// records the offset in the inbox as dead-lettered and parks the record in
// kfn.dead_letters (reason "parked", the operator's reason as the error),
// inside tx. When the offset is the cursor's, the cursor moves past it;
// when it is further ahead, the lane skips it on arrival because its inbox
// row exists. It refuses a record that was handled already, and a caller
// whose token is not the partition's epoch.
func Park(ctx context.Context, tx pgx.Tx, r ParkRequest) (ParkResult, error) {
	p := r.Partition
	if r.Reason == "" {
		return ParkResult{}, errors.New("parking a record needs a reason for the audit log")
	}
	var res ParkResult
	var err error
	if res.Previous, err = lockOwnedCursor(ctx, tx, p, r.Token); err != nil {
		return ParkResult{}, err
	}
	if r.Offset < res.Previous.HighWater {
		return ParkResult{}, fmt.Errorf("%w: offset %d of %s is below the high-water mark %d", ErrAlreadyHandled, r.Offset, p, res.Previous.HighWater)
	}
	fresh, err := Claim(ctx, tx, p, r.Token, DeadLettered, []int64{r.Offset})
	if err != nil {
		return ParkResult{}, err
	}
	if len(fresh) == 0 {
		return ParkResult{}, fmt.Errorf("%w: offset %d of %s has an inbox row", ErrAlreadyHandled, r.Offset, p)
	}
	var dead DeadLetter
	if r.Record != nil {
		dead = *r.Record
	}
	dead.Partition, dead.Offset, dead.Reason, dead.Attempts = p, r.Offset, ReasonParked, 0
	dead.Error = fmt.Sprintf("parked by %s: %s", r.Actor, r.Reason)
	if _, err := WriteDeadLetter(ctx, tx, dead); err != nil {
		return ParkResult{}, err
	}
	res.Now = res.Previous
	if r.Offset == res.Previous.NextOffset {
		if err := Advance(ctx, tx, p, r.Token, r.Offset, r.Offset+1); err != nil {
			return ParkResult{}, err
		}
		res.Now.NextOffset = r.Offset + 1
		res.Now.HighWater = max(res.Now.HighWater, r.Offset+1)
	}
	err = writeAudit(ctx, tx, r.Actor, "park", p, map[string]any{
		"offset": r.Offset, "epoch": r.Token, "reason": r.Reason, "record_read": r.Record != nil,
		"previous_next_offset": res.Previous.NextOffset,
	})
	if err != nil {
		return ParkResult{}, err
	}
	return res, nil
}
