package inbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// A NATS-triggered function's events on one subject are spread over a
// number of lanes (kfn.subject_lanes, one lane when there is no row); lane k
// is the cursor row with partition k. ClaimLane claims a lane and, when the
// claiming worker is configured with another count, changes it.

// LaneCountError refuses a worker whose lane count is not the recorded one
// and that was started before the count was last changed: it runs an old
// configuration, and its lanes would split keys differently from the
// current ones.
type LaneCountError struct {
	Consumer   string
	Subject    string
	Recorded   int
	Configured int
	ChangedAt  time.Time
	ChangedBy  string
}

func (e *LaneCountError) Error() string {
	return fmt.Sprintf("function %s: its events on %s have been spread over %d lanes since %s (changed by worker %s), but this worker, started before that, runs %d lanes: restart it with --lanes %d (KFN_LANES)",
		e.Consumer, e.Subject, e.Recorded, e.ChangedAt.UTC().Format(time.RFC3339), e.ChangedBy, e.Configured, e.Recorded)
}

// ClaimLane is TakeOver for lane p.Partition of a NATS-triggered function
// whose events on p.Topic are spread over lanes lanes, each run as keyLanes
// key-lanes. startedAt is when the
// worker started, by the database's clock.
//
// When lanes differs from the recorded count, the claim changes it, in the
// same transaction, provided the worker started after the last change (or
// else it is refused with a *LaneCountError, so that two configurations do
// not change it back and forth):
//   - every cursor row of the old lanes gets token as its epoch, which
//     fences them: an old lane's next commit fails, whoever runs it. If a
//     row already holds a newer epoch, the claim is refused with a
//     *FencedError and succeeds with the next lease term's token;
//   - the new lanes all start at the smallest next_offset of the old lanes
//     (0, from the stream's start, if an old lane never had a cursor): no
//     event of any old lane below it is unhandled, and events above it that
//     were handled are skipped by the event inbox, which is keyed by event
//     id across lanes. Per key, the events not yet applied are applied in
//     stream order, by the key's new lane;
//   - cursor rows of lanes beyond the new count are deleted, and the
//     change is written to the audit log.
func ClaimLane(ctx context.Context, db interface {
	Begin(context.Context) (pgx.Tx, error)
	Querier
}, p Partition, lanes int, token int64, owner string, startedAt time.Time, keyLanes int, wait time.Duration) (Cursor, error) {
	if lanes < 1 || int(p.Partition) >= lanes || p.Partition < 0 {
		return Cursor{}, fmt.Errorf("claim lane %s: lane %d is not one of %d lanes", p, p.Partition, lanes)
	}
	return takeOver(ctx, db, p, token, wait, func(tx pgx.Tx) (Cursor, error) {
		if err := setLanes(ctx, tx, p, lanes, token, owner, startedAt); err != nil {
			return Cursor{}, err
		}
		c, err := ClaimPartition(ctx, tx, p, token, owner, 0)
		if err != nil {
			return Cursor{}, err
		}
		return c, claimKeyLanes(ctx, tx, p, token, keyLanes, c.NextOffset)
	})
}

// setLanes checks the lane count inside tx, changing it if lanes is newer
// (see ClaimLane).
func setLanes(ctx context.Context, tx pgx.Tx, p Partition, lanes int, token int64, owner string, startedAt time.Time) error {
	// The row is locked for the rest of the transaction, so lane claims
	// and changes of the count of one subject take turns.
	if _, err := tx.Exec(ctx, `
INSERT INTO kfn.subject_lanes (consumer, subject, lanes, changed_at) VALUES ($1, $2, 1, 'epoch')
ON CONFLICT DO NOTHING`, p.Consumer, p.Topic); err != nil {
		return fmt.Errorf("lane count of %s on %s: %w", p.Consumer, p.Topic, err)
	}
	var recorded int
	var changedAt time.Time
	var changedBy string
	err := tx.QueryRow(ctx, `
SELECT lanes, changed_at, changed_by FROM kfn.subject_lanes WHERE consumer = $1 AND subject = $2 FOR UPDATE`,
		p.Consumer, p.Topic).Scan(&recorded, &changedAt, &changedBy)
	if err != nil {
		return fmt.Errorf("lane count of %s on %s: %w", p.Consumer, p.Topic, err)
	}
	if recorded == lanes {
		return nil
	}
	if startedAt.Before(changedAt) {
		return &LaneCountError{Consumer: p.Consumer, Subject: p.Topic, Recorded: recorded, Configured: lanes, ChangedAt: changedAt, ChangedBy: changedBy}
	}

	var rows int
	var start, newest int64
	err = tx.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE partition < $3), coalesce(min(next_offset) FILTER (WHERE partition < $3), 0), coalesce(max(epoch), 0)
  FROM kfn.cursors WHERE consumer = $1 AND topic = $2`, p.Consumer, p.Topic, recorded).Scan(&rows, &start, &newest)
	if err != nil {
		return fmt.Errorf("read the lanes of %s on %s: %w", p.Consumer, p.Topic, err)
	}
	if newest > token {
		return &FencedError{Partition: p, Token: token, Epoch: newest}
	}
	if rows < recorded {
		start = 0 // an old lane never claimed: nothing of it is handled
	}
	if _, err := tx.Exec(ctx, `DELETE FROM kfn.cursors WHERE consumer = $1 AND topic = $2 AND partition >= $3`, p.Consumer, p.Topic, lanes); err != nil {
		return fmt.Errorf("drop the lanes of %s on %s beyond %d: %w", p.Consumer, p.Topic, lanes, err)
	}
	if _, err := tx.Exec(ctx, `
INSERT INTO kfn.cursors AS c (consumer, topic, partition, next_offset, high_water, epoch, owner)
SELECT $1, $2, lane, $4, $4, $5, $6 FROM generate_series(0, $3 - 1) AS lane
ON CONFLICT (consumer, topic, partition) DO UPDATE
   SET next_offset = EXCLUDED.next_offset, epoch = EXCLUDED.epoch, owner = EXCLUDED.owner, claimed_at = now(), updated_at = now()`,
		p.Consumer, p.Topic, lanes, start, token, owner); err != nil {
		return fmt.Errorf("start %d lanes of %s on %s: %w", lanes, p.Consumer, p.Topic, err)
	}
	if _, err := tx.Exec(ctx, `
UPDATE kfn.subject_lanes SET lanes = $3, changed_at = now(), changed_by = $4 WHERE consumer = $1 AND subject = $2`,
		p.Consumer, p.Topic, lanes, owner); err != nil {
		return fmt.Errorf("record %d lanes of %s on %s: %w", lanes, p.Consumer, p.Topic, err)
	}
	return writeAudit(ctx, tx, owner, "lanes_changed", p, map[string]any{"from": recorded, "to": lanes, "start_seq": start, "epoch": token})
}

// LaneMovedAt returns when lane p's cursor last moved (a commit, or the
// change of the lane count that set it), by the database's clock.
func LaneMovedAt(ctx context.Context, db Querier, p Partition) (time.Time, error) {
	var at time.Time
	err := db.QueryRow(ctx, `SELECT updated_at FROM kfn.cursors WHERE consumer = $1 AND topic = $2 AND partition = $3`,
		p.Consumer, p.Topic, p.Partition).Scan(&at)
	if err != nil {
		return time.Time{}, fmt.Errorf("read cursor of %s: %w", p, err)
	}
	return at, nil
}
