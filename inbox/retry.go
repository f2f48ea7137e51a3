package inbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/internal/pgdata"
)

// Retrying a dead letter (`kfn dlq retry`) happens in two steps. An operator
// marks letters (MarkForRetry): retry_requested_at, the actor and the
// reason, with an audit row per letter, and a notification on
// RetryNotifyChannel. The worker lane that owns a letter's partition (or
// subject) then applies it in a transaction of its own: FenceLane, then
// TakeForRetry, which deletes the letter only while it is still marked, then
// the inbox row (MarkRetryApplied or MarkEventRetryApplied), the handler,
// the outbox rows and AuditRetryApplied. So a letter is applied at most
// once: a second retry, or a second lane, finds no marked letter to delete.
// A retry that fails rolls all of that back and records the failure in a
// transaction of its own (RetryFailed): the letter stays, unmarked, with its
// attempts counted and the new error.

// Audit actions of dead letter retries.
const (
	ActionRetryRequested = "dlq_retry_requested"
	ActionRetryApplied   = "dlq_retry_applied"
	ActionRetryFailed    = "dlq_retry_failed"
)

// RetryNotifyChannel is the Postgres notification channel MarkForRetry
// signals at commit, with the function's name as payload, so that workers
// look for marked letters at once instead of at their next poll.
const RetryNotifyChannel = "kfn_dlq_retry"

// ErrAlreadyApplied means the inbox says the record of a dead letter was
// applied since it was dead-lettered (by a re-execution): retrying it would
// apply it twice.
var ErrAlreadyApplied = errors.New("the inbox says the record was applied since it was dead-lettered (a re-execution?): not applying it again")

// RetrySelection picks dead letters: those of Function (and Topic and
// Partition and DeadReason, when set), or exactly the IDs given.
type RetrySelection struct {
	Function   string
	Topic      string
	Partition  int32 // -1: every partition
	DeadReason string
	IDs        []int64
	Limit      int // at most this many; default 1000
}

// RetryRequest asks to retry the selected dead letters.
type RetryRequest struct {
	RetrySelection
	Actor  string // who asks, for the audit log
	Reason string // why; required
}

// RetryMark is one selected dead letter.
type RetryMark struct {
	ID         int64     `json:"id"`
	Partition  Partition `json:"partition"`
	Offset     int64     `json:"offset"`
	DeadReason string    `json:"dead_reason"`
	Attempts   int       `json:"attempts"`
	// Refused says why the letter was not marked; empty when it was.
	Refused string `json:"refused,omitempty"`
}

// RetryMarks is what MarkForRetry did.
type RetryMarks struct {
	Marked      []RetryMark
	Refused     []RetryMark
	RequestedAt time.Time
	// AuditMark is the largest kfn.audit_log id before the request: the
	// outcomes of the marked letters are audited after it (RetryOutcomes).
	AuditMark int64
}

// defaultRetryLimit bounds one request when RetrySelection.Limit is 0.
const defaultRetryLimit = 1000

// MarkForRetry marks the selected dead letters for retry inside tx, with an
// audit row per letter, and notifies the workers at commit. It refuses
// (marks not) what cannot be retried from its dead letter: an oversized
// record (the letter keeps only part of it) and a record parked without its
// bytes; both must be read again from Kafka (kfn replay). It refuses a
// key_parked letter whose key is still parked behind an earlier dead letter
// (ReleaseKeys marks it when that one goes). An ID with no dead letter is
// refused too. A letter marked already is marked again, by this
// request.
func MarkForRetry(ctx context.Context, tx pgx.Tx, r RetryRequest) (RetryMarks, error) {
	var res RetryMarks
	switch {
	case r.Reason == "":
		return res, errors.New("a retry needs a reason for the audit log")
	case r.Function == "" && len(r.IDs) == 0:
		return res, errors.New("select the dead letters to retry: a function, or their ids")
	}
	limit := r.Limit
	if limit <= 0 {
		limit = defaultRetryLimit
	}
	if err := tx.QueryRow(ctx, `SELECT now(), coalesce((SELECT max(id) FROM kfn.audit_log), 0)`).Scan(&res.RequestedAt, &res.AuditMark); err != nil {
		return res, fmt.Errorf("retry dead letters: %w", err)
	}
	ids := r.IDs
	if ids == nil {
		ids = []int64{}
	}
	// A key_parked letter whose key is still blocked by an earlier dead
	// letter is refused: it must not be applied before that one. (The lane
	// checks again when it applies a letter: see engine's retry_lane.go.)
	rows, err := tx.Query(ctx, `
SELECT d.id, d.consumer, d.topic, d.partition, d."offset", d.reason, d.attempts,
       d.value_sha256 IS NOT NULL OR d.reason = 'oversized',
       d.reason = $7 AND d.raw IS NULL AND d.record_key IS NULL AND d.value IS NULL AND d.record_time IS NULL
           AND coalesce(cardinality(d.header_keys), 0) = 0,
       (SELECT k.blocking_offset FROM kfn.parked_keys k
         WHERE d.reason = $8 AND k.consumer = d.consumer AND k.topic = d.topic AND k.partition = d.partition
           AND k.record_key = d.record_key AND k.blocking_offset < d."offset"),
       (SELECT b.id FROM kfn.parked_keys k JOIN kfn.dead_letters b
            ON b.consumer = k.consumer AND b.topic = k.topic AND b.partition = k.partition AND b."offset" = k.blocking_offset
         WHERE d.reason = $8 AND k.consumer = d.consumer AND k.topic = d.topic AND k.partition = d.partition
           AND k.record_key = d.record_key AND k.blocking_offset < d."offset")
  FROM kfn.dead_letters d
 WHERE ($1 = '' OR d.consumer = $1) AND ($2 = '' OR d.topic = $2) AND ($3 < 0 OR d.partition = $3)
   AND ($4 = '' OR d.reason = $4) AND (cardinality($5::bigint[]) = 0 OR d.id = ANY($5))
 ORDER BY d.consumer, d.topic, d.partition, d."offset"
 LIMIT $6
   FOR UPDATE OF d`, r.Function, r.Topic, r.Partition, r.DeadReason, ids, limit, ReasonParked, ReasonKeyParked)
	if err != nil {
		return res, fmt.Errorf("select dead letters to retry: %w", err)
	}
	found := map[int64]bool{}
	var m RetryMark
	var oversized, noBytes bool
	var blockingOffset, blockerID *int64
	_, err = pgx.ForEachRow(rows, []any{&m.ID, &m.Partition.Consumer, &m.Partition.Topic, &m.Partition.Partition, &m.Offset,
		&m.DeadReason, &m.Attempts, &oversized, &noBytes, &blockingOffset, &blockerID}, func() error {
		found[m.ID] = true
		switch {
		case blockingOffset != nil:
			blocker := fmt.Sprintf("the dead letter at offset %d", *blockingOffset)
			if blockerID != nil {
				blocker = fmt.Sprintf("dead letter %d (offset %d)", *blockerID, *blockingOffset)
			}
			m.Refused = "key_parked: its key is parked behind " + blocker + ", which must be applied first; " +
				"retry or discard that one, and this one follows it in offset order"
			res.Refused = append(res.Refused, m)
		case oversized:
			m.Refused = "oversized: its dead letter keeps only part of the record, so it cannot be retried from there; re-read it from Kafka with `kfn replay` instead"
			res.Refused = append(res.Refused, m)
		case noBytes:
			m.Refused = "parked without the record's bytes (kfn dlq park had no --kafka-brokers), so it cannot be retried from its dead letter; re-read it from Kafka with `kfn replay` instead"
			res.Refused = append(res.Refused, m)
		default:
			res.Marked = append(res.Marked, m)
		}
		return nil
	})
	if err != nil {
		return res, fmt.Errorf("select dead letters to retry: %w", err)
	}
	for _, id := range r.IDs {
		if !found[id] {
			res.Refused = append(res.Refused, RetryMark{ID: id, Refused: "no such dead letter" + selectionNote(r.RetrySelection) +
				" (applied by an earlier retry, or discarded?)"})
		}
	}
	if len(res.Marked) == 0 {
		return res, nil
	}
	marked := make([]int64, len(res.Marked))
	for i, m := range res.Marked {
		marked[i] = m.ID
	}
	_, err = tx.Exec(ctx, `UPDATE kfn.dead_letters SET retry_requested_at = $2, retry_actor = $3, retry_reason = $4 WHERE id = ANY($1)`,
		marked, res.RequestedAt, pgdata.Text(r.Actor), pgdata.Text(r.Reason))
	if err != nil {
		return res, fmt.Errorf("mark dead letters for retry: %w", err)
	}
	notified := map[string]bool{}
	for _, m := range res.Marked {
		err := writeAudit(ctx, tx, r.Actor, ActionRetryRequested, m.Partition, map[string]any{
			"dead_letter_id": m.ID, "offset": m.Offset, "reason": r.Reason, "dead_reason": m.DeadReason, "attempts": m.Attempts,
		})
		if err != nil {
			return res, err
		}
		if !notified[m.Partition.Consumer] {
			notified[m.Partition.Consumer] = true
			if _, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, RetryNotifyChannel, m.Partition.Consumer); err != nil {
				return res, fmt.Errorf("notify the workers: %w", err)
			}
		}
	}
	return res, nil
}

// selectionNote names the filters an id was looked up with.
func selectionNote(s RetrySelection) string {
	note := ""
	if s.Function != "" {
		note += " of function " + s.Function
	}
	if s.Topic != "" {
		note += " on " + s.Topic
	}
	if s.Partition >= 0 {
		note += " partition " + strconv.Itoa(int(s.Partition))
	}
	if s.DeadReason != "" {
		note += " with reason " + s.DeadReason
	}
	return note
}

// PendingRetryLanes returns the lanes of the given consumers that have dead
// letters marked for retry: one cheap query (a partial index holds only
// the marked letters), which a worker runs every few seconds.
func PendingRetryLanes(ctx context.Context, db Querier, consumers []string) ([]Partition, error) {
	rows, err := db.Query(ctx, `
SELECT DISTINCT consumer, topic, partition FROM kfn.dead_letters
 WHERE retry_requested_at IS NOT NULL AND consumer = ANY($1)`, consumers)
	if err != nil {
		return nil, fmt.Errorf("look for dead letters to retry: %w", err)
	}
	lanes, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Partition])
	if err != nil {
		return nil, fmt.Errorf("look for dead letters to retry: %w", err)
	}
	return lanes, nil
}

// PendingRetries returns the ids of up to limit dead letters of p marked for
// retry, in offset order.
func PendingRetries(ctx context.Context, db Querier, p Partition, limit int) ([]int64, error) {
	rows, err := db.Query(ctx, `
SELECT id FROM kfn.dead_letters
 WHERE consumer = $1 AND topic = $2 AND partition = $3 AND retry_requested_at IS NOT NULL
 ORDER BY "offset" LIMIT $4`, p.Consumer, p.Topic, p.Partition, limit)
	if err != nil {
		return nil, fmt.Errorf("list dead letters of %s to retry: %w", p, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("list dead letters of %s to retry: %w", p, err)
	}
	return ids, nil
}

// FenceLane checks inside tx that token is still the lane's epoch, without
// moving its cursor: it writes the cursor row (updated_at only) under the
// token, which locks the row until tx ends exactly as a batch's fence does,
// so the transaction commits only while the lane is the caller's. It is the
// fence of a lane's transactions that apply no new records (a dead letter
// retry). Zero rows means fenced: a *FencedError.
func FenceLane(ctx context.Context, tx pgx.Tx, p Partition, token int64) error {
	return fenceBy(ctx, tx, p, token, `UPDATE kfn.cursors SET updated_at = now() WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch = $4`)
}

// RetryLetter is a dead letter taken for a retry.
type RetryLetter struct {
	DeadLetter
	RequestedAt time.Time
	Actor       string // who asked for the retry
	Why         string // the reason they gave
}

// TakeForRetry deletes dead letter id of p inside tx, provided it is still
// marked for retry, and returns it; false when there is no such marked
// letter (applied by an earlier retry, no longer marked, or discarded). The
// caller applies the record in the same transaction: if it rolls back, the
// letter is back.
func TakeForRetry(ctx context.Context, tx pgx.Tx, p Partition, id int64) (RetryLetter, bool, error) {
	var l RetryLetter
	var headerKeys, headerValues [][]byte
	var raw []byte
	var recordTime *time.Time
	var valueSize *int64
	var actor, why *string
	err := tx.QueryRow(ctx, `
DELETE FROM kfn.dead_letters
 WHERE id = $1 AND consumer = $2 AND topic = $3 AND partition = $4 AND retry_requested_at IS NOT NULL
RETURNING "offset", record_key, value, header_keys, header_values, value_size, value_sha256, raw, record_time,
          reason, error, attempts, dead_at, retry_requested_at, retry_actor, retry_reason`, id, p.Consumer, p.Topic, p.Partition).
		Scan(&l.Offset, &l.Key, &l.Value, &headerKeys, &headerValues, &valueSize, &l.ValueSHA256, &raw, &recordTime,
			&l.Reason, &l.Error, &l.Attempts, &l.DeadAt, &l.RequestedAt, &actor, &why)
	if errors.Is(err, pgx.ErrNoRows) {
		return l, false, nil
	}
	if err != nil {
		return l, false, fmt.Errorf("take dead letter %d of %s for a retry: %w", id, p, err)
	}
	l.ID, l.Partition = id, p
	if valueSize != nil {
		l.ValueSize = *valueSize
	}
	if recordTime != nil {
		l.RecordTime = *recordTime
	}
	if actor != nil {
		l.Actor = *actor
	}
	if why != nil {
		l.Why = *why
	}
	if raw != nil {
		l.StoredRaw = true
		if l.Key, l.Value, l.Headers, err = DecodeRaw(raw); err != nil {
			return l, true, fmt.Errorf("dead letter %d: %w", id, err)
		}
		return l, true, nil
	}
	if len(headerKeys) != len(headerValues) {
		return l, true, fmt.Errorf("dead letter %d: %d header names but %d header values", id, len(headerKeys), len(headerValues))
	}
	for i := range headerKeys {
		l.Headers = append(l.Headers, Header{Key: nonNil(headerKeys[i]), Value: headerValues[i]})
	}
	return l, true, nil
}

// MarkRetryApplied records a retried Kafka record as applied in the inbox,
// inside tx: its dead_lettered row becomes applied, or a row is written if
// retention purged it. It returns ErrAlreadyApplied when the row says
// applied already.
func MarkRetryApplied(ctx context.Context, tx pgx.Tx, p Partition, token, offset int64) error {
	tag, err := tx.Exec(ctx, withLane+`
INSERT INTO kfn.inbox AS i (lane, "offset", epoch, outcome) VALUES ((SELECT id FROM lane), $4, $5, 'applied')
ON CONFLICT (lane, "offset") DO UPDATE SET outcome = 'applied', epoch = EXCLUDED.epoch, processed_at = now()
 WHERE i.outcome = 'dead_lettered'`, p.Consumer, p.Topic, p.Partition, offset, token)
	if err != nil {
		return fmt.Errorf("mark %s@%d applied in the inbox: %w", p, offset, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%s@%d: %w", p, offset, ErrAlreadyApplied)
	}
	return nil
}

// MarkEventRetryApplied is MarkRetryApplied for an event of a NATS-triggered
// consumer. It returns the subject stored for the event (e.Subject when the
// event's row was purged).
func MarkEventRetryApplied(ctx context.Context, tx pgx.Tx, consumer string, token int64, e EventRef) (string, error) {
	var subject string
	err := tx.QueryRow(ctx, `
INSERT INTO kfn.event_inbox AS i (consumer, event_id, subject, stream_seq, epoch, outcome) VALUES ($1, $2, $3, $4, $5, 'applied')
ON CONFLICT (consumer, event_id) DO UPDATE SET outcome = 'applied', epoch = EXCLUDED.epoch, processed_at = now()
 WHERE i.outcome = 'dead_lettered'
RETURNING subject`, consumer, e.ID, pgdata.Text(e.Subject), e.StreamSeq, token).Scan(&subject)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("event %s of %s: %w", e.ID, consumer, ErrAlreadyApplied)
	}
	if err != nil {
		return "", fmt.Errorf("mark event %s of %s applied: %w", e.ID, consumer, err)
	}
	return subject, nil
}

// AuditRetryApplied writes, inside the retry's transaction, that actor (the
// worker) applied dead letter l under token.
func AuditRetryApplied(ctx context.Context, tx pgx.Tx, actor string, l RetryLetter, token int64, eventID string) error {
	details := retryDetails(l, token)
	if eventID != "" {
		details["event_id"] = eventID
	}
	return writeAudit(ctx, tx, actor, ActionRetryApplied, l.Partition, details)
}

func retryDetails(l RetryLetter, token int64) map[string]any {
	return map[string]any{
		"dead_letter_id": l.ID, "offset": l.Offset, "epoch": token, "dead_reason": l.Reason, "attempts": l.Attempts,
		"requested_by": l.Actor, "reason": l.Why, "requested_at": l.RequestedAt,
	}
}

// RetryFailed records inside tx that a retry of dead letter l failed with
// cause: the letter stays, no longer marked, with one more attempt and the
// error, and an audit row. It changes nothing and returns false when the
// letter is gone or was marked again since l was taken (the new request
// retries it).
func RetryFailed(ctx context.Context, tx pgx.Tx, actor string, l RetryLetter, token int64, cause string) (bool, error) {
	tag, err := tx.Exec(ctx, `
UPDATE kfn.dead_letters
   SET retry_requested_at = NULL, attempts = attempts + 1, last_retry_at = now(), last_retry_error = $3
 WHERE id = $1 AND retry_requested_at = $2`, l.ID, l.RequestedAt, pgdata.Text(cause))
	if err != nil {
		return false, fmt.Errorf("record the failed retry of dead letter %d: %w", l.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return false, nil
	}
	details := retryDetails(l, token)
	details["error"] = pgdata.Text(cause)
	return true, writeAudit(ctx, tx, actor, ActionRetryFailed, l.Partition, details)
}

// RetryOutcome is how the retry of one dead letter ended.
type RetryOutcome struct {
	ID      int64  `json:"id"`
	Outcome string `json:"outcome"` // applied, failed, or pending
	Error   string `json:"error,omitempty"`
	// By is the worker that applied it or failed it.
	By string    `json:"by,omitempty"`
	At time.Time `json:"at,omitzero"`
}

// Retry outcomes.
const (
	RetryApplied     = "applied"
	RetryFailedAgain = "failed"
	RetryPending     = "pending"
	// RetryGone is a letter that disappeared without being applied
	// (discarded by an operator).
	RetryGone = "gone"
)

// RetryOutcomes reads the outcomes of the retries of ids audited after
// auditMark (see RetryMarks), and says which of the others are pending
// still and which are gone.
func RetryOutcomes(ctx context.Context, db Querier, auditMark int64, ids []int64) (map[int64]RetryOutcome, error) {
	// Which letters exist first, their audit rows second: a retry that
	// commits in between deletes its letter and writes its audit row in one
	// transaction, so a letter missing here has its audit row visible below.
	rows, err := db.Query(ctx, `SELECT id FROM kfn.dead_letters WHERE id = ANY($1)`, ids)
	if err != nil {
		return nil, fmt.Errorf("read retry outcomes: %w", err)
	}
	present, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("read retry outcomes: %w", err)
	}
	exists := map[int64]bool{}
	for _, id := range present {
		exists[id] = true
	}
	out := make(map[int64]RetryOutcome, len(ids))
	rows, err = db.Query(ctx, `
SELECT (details->>'dead_letter_id')::bigint, action, coalesce(details->>'error', ''), actor, at
  FROM kfn.audit_log
 WHERE id > $1 AND action IN ($3, $4) AND (details->>'dead_letter_id')::bigint = ANY($2)
 ORDER BY id`, auditMark, ids, ActionRetryApplied, ActionRetryFailed)
	if err != nil {
		return nil, fmt.Errorf("read retry outcomes: %w", err)
	}
	var o RetryOutcome
	var action string
	_, err = pgx.ForEachRow(rows, []any{&o.ID, &action, &o.Error, &o.By, &o.At}, func() error {
		if _, done := out[o.ID]; done {
			return nil // the first outcome after the request is its outcome
		}
		o.Outcome = RetryFailedAgain
		if action == ActionRetryApplied {
			o.Outcome = RetryApplied
		}
		out[o.ID] = o
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read retry outcomes: %w", err)
	}
	for _, id := range ids {
		if _, done := out[id]; done {
			continue
		}
		out[id] = RetryOutcome{ID: id, Outcome: RetryPending}
		if !exists[id] {
			out[id] = RetryOutcome{ID: id, Outcome: RetryGone, Error: "the dead letter is gone, and no retry applied it (discarded?)"}
		}
	}
	return out, nil
}
