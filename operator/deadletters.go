package operator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/inbox"
)

// DeadLetterFilter selects dead letters by id, coordinates, reason, error
// text and time; see inbox.DeadLetterFilter.
type DeadLetterFilter = inbox.DeadLetterFilter

// ListDeadLetters returns the dead letters f selects, oldest first, with
// their bytes (a raw-blob dead letter decoded).
func ListDeadLetters(ctx context.Context, db inbox.Querier, f DeadLetterFilter) ([]inbox.DeadLetter, error) {
	return inbox.FindDeadLetters(ctx, db, f)
}

// NotFoundError names dead letter ids that do not exist.
type NotFoundError struct{ IDs []int64 }

func (e *NotFoundError) Error() string {
	ids := make([]string, len(e.IDs))
	for i, id := range e.IDs {
		ids[i] = fmt.Sprint(id)
	}
	noun := "dead letter"
	if len(ids) > 1 {
		noun += "s"
	}
	return fmt.Sprintf("no %s %s (discarded or purged already? kfn dlq list shows the ids)", noun, strings.Join(ids, ", "))
}

// ShowDeadLetter returns one dead letter, whole: its coordinates, reason,
// error, attempts, time, key, value and headers.
func ShowDeadLetter(ctx context.Context, db inbox.Querier, id int64) (inbox.DeadLetter, error) {
	dead, err := inbox.FindDeadLetters(ctx, db, DeadLetterFilter{IDs: []int64{id}})
	if err != nil {
		return inbox.DeadLetter{}, err
	}
	if len(dead) == 0 {
		return inbox.DeadLetter{}, &NotFoundError{IDs: []int64{id}}
	}
	return dead[0], nil
}

// DiscardRequest asks to delete dead letters for good.
type DiscardRequest struct {
	// Filter selects what goes: ids, or coordinates, reason, error text and
	// time. A filter that selects everything is refused unless All is set.
	Filter DeadLetterFilter
	All    bool
	Actor  string
	Reason string // required, for the audit log
	// DryRun only reads what would go.
	DryRun bool
}

// DiscardResult says what went (or would go): the dead letters without
// their values.
type DiscardResult struct {
	DeadLetters []inbox.DeadLetter
	// Released are the keys the discarded dead letters had parked (a
	// function with KeyOrder ParkKey): their key_parked letters are now
	// marked for retry, and the lanes apply them in offset order.
	Released []inbox.ReleasedKey
	DryRun   bool
}

// ErrDiscardEverything refuses a discard whose filter selects every dead
// letter, when DiscardRequest.All was not set.
var ErrDiscardEverything = errors.New("the discard selects every dead letter: give ids or a filter, or say so with --all")

// DiscardDeadLetters deletes the dead letters req.Filter selects, in one
// transaction with one audit row per dead letter (action "discard"). When
// the filter names ids, all of them must exist, or nothing is discarded.
// The records stay handled: their inbox rows still say dead-lettered, so
// nothing re-applies them. A discarded dead letter that parked its key
// releases it in the same transaction (see DiscardResult.Released).
func DiscardDeadLetters(ctx context.Context, pool *pgxpool.Pool, req DiscardRequest) (DiscardResult, error) {
	if strings.TrimSpace(req.Reason) == "" {
		return DiscardResult{}, errors.New("discarding dead letters needs a reason for the audit log")
	}
	if !req.Filter.Narrows() && !req.All {
		return DiscardResult{}, ErrDiscardEverything
	}
	res := DiscardResult{DryRun: req.DryRun}
	if req.DryRun {
		f := req.Filter
		f.WithoutValue = true
		dead, err := inbox.FindDeadLetters(ctx, pool, f)
		if err != nil {
			return DiscardResult{}, err
		}
		if err := allFound(req.Filter.IDs, dead); err != nil {
			return DiscardResult{}, err
		}
		res.DeadLetters = dead
		return res, nil
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		dead, released, err := inbox.DiscardAndRelease(ctx, tx, req.Filter, req.Actor, req.Reason)
		if err != nil {
			return err
		}
		if err := allFound(req.Filter.IDs, dead); err != nil {
			return err // rolled back: nothing discarded
		}
		res.DeadLetters, res.Released = dead, released
		return nil
	})
	if err != nil {
		return DiscardResult{}, err
	}
	return res, nil
}

// allFound says which of ids are not among dead.
func allFound(ids []int64, dead []inbox.DeadLetter) error {
	var missing []int64
	for _, id := range ids {
		if !slices.ContainsFunc(dead, func(d inbox.DeadLetter) bool { return d.ID == id }) {
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		return &NotFoundError{IDs: missing}
	}
	return nil
}

// PurgeRequest asks to delete every dead letter older than an age.
type PurgeRequest struct {
	OlderThan time.Duration // dead-lettered more than this long ago (by the database's clock)
	Actor     string
	Reason    string // for the audit log; default "older than <OlderThan>"
	DryRun    bool   // only count
}

// PurgeResult says how many dead letters went (or would go), and the
// cut-off time.
type PurgeResult struct {
	Before time.Time
	Count  int64
	DryRun bool
}

// PurgeDeadLetters deletes every dead letter older than req.OlderThan in one
// transaction, audited as one row (action "purge") with the count. The
// worker's --dead-letter-retention does the same on its own.
func PurgeDeadLetters(ctx context.Context, pool *pgxpool.Pool, req PurgeRequest) (PurgeResult, error) {
	if req.OlderThan <= 0 {
		return PurgeResult{}, fmt.Errorf("purge dead letters: the age must be positive, not %s", req.OlderThan)
	}
	if req.Reason == "" {
		req.Reason = "older than " + req.OlderThan.String()
	}
	res := PurgeResult{DryRun: req.DryRun}
	if req.DryRun {
		if err := pool.QueryRow(ctx, `SELECT now() - $1::interval`, req.OlderThan).Scan(&res.Before); err != nil {
			return PurgeResult{}, fmt.Errorf("purge dead letters: %w", err)
		}
		n, err := inbox.CountDeadLetters(ctx, pool, DeadLetterFilter{Until: res.Before})
		res.Count = n
		return res, err
	}
	var err error
	res.Before, res.Count, err = inbox.PurgeDeadLetters(ctx, pool, req.OlderThan, req.Actor, req.Reason)
	return res, err
}
