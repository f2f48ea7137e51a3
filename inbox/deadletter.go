package inbox

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/internal/pgdata"
)

// Header is one record header. Name and value are bytes, as Kafka has
// them: a name may hold any byte, and a nil value is a null header value.
type Header struct {
	Key   []byte `json:"key"`
	Value []byte `json:"value"`
}

// HeadersOf copies a record's headers for its dead letter: a record's
// header (runtime.Header) is a Key string and a Value []byte, stored here
// as bytes so that any name survives.
func HeadersOf[H ~struct {
	Key   string
	Value []byte
}](hs []H) []Header {
	out := make([]Header, len(hs))
	for i, h := range hs {
		kv := struct {
			Key   string
			Value []byte
		}(h)
		out[i] = Header{Key: []byte(kv.Key), Value: kv.Value}
	}
	return out
}

// DeadLetter is a record that could not be applied, with why.
//
// Key, Value and the header names and values are stored as bytea, byte for
// byte as the record had them. Error is text: kfn writes it through
// pgdata.Text, so a handler error that quotes a record's bytes cannot make
// the dead letter itself fail.
type DeadLetter struct {
	ID         int64
	Partition  Partition
	Offset     int64
	Key        []byte
	Value      []byte // the value, or its first bytes when ValueSHA256 is set
	Headers    []Header
	RecordTime time.Time
	Reason     string // short machine-friendly cause: handler_error, permanent, panic, oversized, timeout, data_error, parked, key_parked
	Error      string // the full error text
	Attempts   int
	DeadAt     time.Time
	// ValueSize is the length of the record's whole value (0 for a null
	// one). WriteDeadLetter takes it from Value unless ValueSHA256 is set.
	ValueSize int64
	// ValueSHA256 is the SHA-256 of the whole value when Value holds only a
	// prefix of it (an oversized record); nil when Value is whole.
	ValueSHA256 []byte
	// StoredRaw says the row could not be written column by column (a
	// Postgres data error) and the record was parked as one raw blob
	// (EncodeRaw); ListDeadLetters decodes it back into Key, Value and
	// Headers.
	StoredRaw bool
}

// WriteDeadLetter parks a record inside tx. The caller also records the
// record in its inbox as dead-lettered (MarkDeadLettered for Kafka records),
// so a replay does not apply it behind the operator's back. A re-execution
// that dead-letters the record again updates the row.
//
// The write always succeeds unless the database fails: it runs in a
// savepoint, and if Postgres refuses the row with a data error
// (pgdata.IsDataError) it rolls back to the savepoint and parks the record
// as one raw bytea blob with the reason, so the lane moves on. It reports
// whether it had to do that.
func WriteDeadLetter(ctx context.Context, tx pgx.Tx, d DeadLetter) (storedRaw bool, err error) {
	err = pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error { return insertDeadLetter(ctx, sp, d) })
	if err == nil {
		return false, nil
	}
	if !pgdata.IsDataError(err) {
		return false, fmt.Errorf("dead-letter %s@%d: %w", d.Partition, d.Offset, err)
	}
	raw := d
	raw.Error = d.Error + "\n(kfn: the dead letter could not be stored column by column, so the record is stored as a raw blob: " + err.Error() + ")"
	raw.StoredRaw = true
	if err := insertDeadLetter(ctx, tx, raw); err != nil {
		return false, fmt.Errorf("dead-letter %s@%d as a raw blob: %w", d.Partition, d.Offset, err)
	}
	return true, nil
}

func insertDeadLetter(ctx context.Context, tx pgx.Tx, d DeadLetter) error {
	var recordTime *time.Time
	if !d.RecordTime.IsZero() {
		recordTime = &d.RecordTime
	}
	var key, value, raw []byte
	var headerKeys, headerValues [][]byte
	if d.StoredRaw {
		raw = EncodeRaw(d.Key, d.Value, d.Headers)
	} else {
		key, value = d.Key, d.Value
		headerKeys, headerValues = make([][]byte, len(d.Headers)), make([][]byte, len(d.Headers))
		for i, h := range d.Headers {
			headerKeys[i], headerValues[i] = nonNil(h.Key), h.Value
		}
	}
	var valueSize *int64
	switch {
	case d.ValueSHA256 != nil: // Value is a prefix
		valueSize = &d.ValueSize
	case d.Value != nil:
		n := int64(len(d.Value))
		valueSize = &n
	}
	_, err := tx.Exec(ctx, `
INSERT INTO kfn.dead_letters (consumer, topic, partition, "offset", record_key, value, header_keys, header_values,
                              value_size, value_sha256, raw, record_time, reason, error, attempts)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
ON CONFLICT (consumer, topic, partition, "offset") DO UPDATE
   SET record_key = EXCLUDED.record_key, value = EXCLUDED.value, header_keys = EXCLUDED.header_keys,
       header_values = EXCLUDED.header_values, value_size = EXCLUDED.value_size, value_sha256 = EXCLUDED.value_sha256,
       raw = EXCLUDED.raw, reason = EXCLUDED.reason, error = EXCLUDED.error, attempts = EXCLUDED.attempts, dead_at = now()`,
		d.Partition.Consumer, d.Partition.Topic, d.Partition.Partition, d.Offset, key, value, headerKeys, headerValues,
		valueSize, d.ValueSHA256, raw, recordTime, pgdata.Text(d.Reason), pgdata.Text(d.Error), d.Attempts)
	return err
}

// nonNil keeps an empty header name an empty bytea rather than NULL.
func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// ListDeadLetters returns the dead letters of a consumer (every consumer's
// when consumer is ""), oldest first, at most limit of them. A dead letter
// stored as a raw blob comes back decoded, with StoredRaw set.
func ListDeadLetters(ctx context.Context, db Querier, consumer string, limit int) ([]DeadLetter, error) {
	return FindDeadLetters(ctx, db, DeadLetterFilter{Consumer: consumer, Limit: limit})
}

// DeadLetterFilter selects dead letters. Every field set narrows the
// selection; the zero filter selects them all.
type DeadLetterFilter struct {
	IDs           []int64   // only these ids
	Consumer      string    // only this consumer (function)
	Topic         string    // only this source topic
	Partition     *int32    // only this partition
	Reason        string    // only this reason (handler_error, permanent, parked, …)
	ErrorContains string    // only those whose error text contains this (case-sensitive)
	Since         time.Time // only those dead-lettered at or after this time
	Until         time.Time // only those dead-lettered before this time
	Limit         int       // at most this many, the oldest first; 0: no limit
	// WithoutValue leaves Value out of what is read (for a summary of many
	// dead letters); ValueSize still says how long it was.
	WithoutValue bool
}

// Narrows reports whether f selects fewer than every dead letter (its limit
// aside).
func (f DeadLetterFilter) Narrows() bool {
	return len(f.IDs) > 0 || f.Consumer != "" || f.Topic != "" || f.Partition != nil || f.Reason != "" ||
		f.ErrorContains != "" || !f.Since.IsZero() || !f.Until.IsZero()
}

// where is f's WHERE clause (without the keyword; "true" for no filter)
// and its arguments, numbered from 1.
func (f DeadLetterFilter) where() (string, []any) {
	var w conditions
	if len(f.IDs) > 0 {
		w.add("id = ANY($?::bigint[])", f.IDs)
	}
	if f.Consumer != "" {
		w.add("consumer = $?", f.Consumer)
	}
	if f.Topic != "" {
		w.add("topic = $?", f.Topic)
	}
	if f.Partition != nil {
		w.add("partition = $?", *f.Partition)
	}
	if f.Reason != "" {
		w.add("reason = $?", f.Reason)
	}
	if f.ErrorContains != "" {
		w.add("strpos(error, $?) > 0", f.ErrorContains)
	}
	if !f.Since.IsZero() {
		w.add("dead_at >= $?", f.Since)
	}
	if !f.Until.IsZero() {
		w.add("dead_at < $?", f.Until)
	}
	return w.clause()
}

// FindDeadLetters returns the dead letters f selects, oldest (lowest id)
// first. A dead letter stored as a raw blob comes back decoded, with
// StoredRaw set.
func FindDeadLetters(ctx context.Context, db Querier, f DeadLetterFilter) ([]DeadLetter, error) {
	return findDeadLetters(ctx, db, f, "")
}

// findDeadLetters is FindDeadLetters with a locking clause (FOR UPDATE).
func findDeadLetters(ctx context.Context, db Querier, f DeadLetterFilter, locking string) ([]DeadLetter, error) {
	where, args := f.where()
	value := "value"
	if f.WithoutValue {
		value = "NULL::bytea"
	}
	limit := ""
	if f.Limit > 0 {
		limit = " LIMIT " + strconv.Itoa(f.Limit)
	}
	rows, err := db.Query(ctx, `
SELECT id, consumer, topic, partition, "offset", record_key, `+value+`, header_keys, header_values,
       coalesce(value_size, 0), value_sha256, raw, coalesce(record_time, 'epoch'), reason, error, attempts, dead_at
  FROM kfn.dead_letters WHERE `+where+` ORDER BY id`+limit+" "+locking, args...)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	dead, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadLetter, error) {
		var d DeadLetter
		var headerKeys, headerValues [][]byte
		var raw []byte
		err := r.Scan(&d.ID, &d.Partition.Consumer, &d.Partition.Topic, &d.Partition.Partition, &d.Offset, &d.Key, &d.Value,
			&headerKeys, &headerValues, &d.ValueSize, &d.ValueSHA256, &raw, &d.RecordTime, &d.Reason, &d.Error, &d.Attempts, &d.DeadAt)
		if err != nil {
			return d, err
		}
		if raw != nil {
			d.StoredRaw = true
			d.Key, d.Value, d.Headers, err = DecodeRaw(raw)
			if err != nil {
				return d, fmt.Errorf("dead letter %d: %w", d.ID, err)
			}
			if f.WithoutValue {
				d.Value = nil
			}
			return d, nil
		}
		if len(headerKeys) != len(headerValues) {
			return d, fmt.Errorf("dead letter %d: %d header names but %d header values", d.ID, len(headerKeys), len(headerValues))
		}
		for i := range headerKeys {
			d.Headers = append(d.Headers, Header{Key: nonNil(headerKeys[i]), Value: headerValues[i]})
		}
		return d, nil
	})
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	return dead, nil
}

// Audit actions of the dead letter operations.
const (
	ActionDiscard = "discard" // one dead letter deleted by an operator
	ActionPurge   = "purge"   // the dead letters older than a time deleted, by an operator or the worker's retention
)

// DiscardDeadLetters deletes the dead letters f selects for good, inside
// tx, and writes one audit row (action "discard") per dead letter with the
// actor and the reason. It returns what it deleted, without the values.
// The records' inbox rows stay: they are still handled (dead-lettered), so
// neither a worker nor an idempotent replay applies them. A discarded dead
// letter that parked its key (a function with KeyOrder ParkKey) releases
// it, in tx: see DiscardAndRelease.
func DiscardDeadLetters(ctx context.Context, tx pgx.Tx, f DeadLetterFilter, actor, reason string) ([]DeadLetter, error) {
	dead, _, err := DiscardAndRelease(ctx, tx, f, actor, reason)
	return dead, err
}

// DiscardAndRelease is DiscardDeadLetters, also returning the keys it
// released (ReleaseKeys): those the discarded dead letters blocked, whose
// key_parked letters are now marked for retry, to be applied in offset
// order by the lanes.
func DiscardAndRelease(ctx context.Context, tx pgx.Tx, f DeadLetterFilter, actor, reason string) ([]DeadLetter, []ReleasedKey, error) {
	if reason == "" {
		return nil, nil, errors.New("discarding dead letters needs a reason for the audit log")
	}
	f.WithoutValue = true
	dead, err := findDeadLetters(ctx, tx, f, "FOR UPDATE")
	if err != nil || len(dead) == 0 {
		return nil, nil, err
	}
	ids := make([]int64, len(dead))
	for i, d := range dead {
		ids[i] = d.ID
	}
	_, err = tx.Exec(ctx, `
INSERT INTO kfn.audit_log (actor, action, consumer, topic, partition, details)
SELECT $1, $2, consumer, topic, partition,
       jsonb_build_object('dead_letter_id', id, 'offset', "offset", 'dead_letter_reason', reason, 'attempts', attempts,
                          'dead_at', dead_at, 'error', left(error, 200), 'reason', $3::text)
  FROM kfn.dead_letters WHERE id = ANY($4::bigint[]) ORDER BY id`, actor, ActionDiscard, reason, ids)
	if err != nil {
		return nil, nil, fmt.Errorf("audit the discard of %d dead letters: %w", len(ids), err)
	}
	tag, err := tx.Exec(ctx, `DELETE FROM kfn.dead_letters WHERE id = ANY($1::bigint[])`, ids)
	if err != nil {
		return nil, nil, fmt.Errorf("discard %d dead letters: %w", len(ids), err)
	}
	if tag.RowsAffected() != int64(len(ids)) {
		return nil, nil, fmt.Errorf("discard dead letters: deleted %d rows of the %d locked", tag.RowsAffected(), len(ids))
	}
	refs := make([]LetterRef, len(dead))
	for i, d := range dead {
		refs[i] = LetterRef{Partition: d.Partition, Offset: d.Offset}
	}
	released, err := ReleaseKeys(ctx, tx, actor, "discarded", refs)
	if err != nil {
		return nil, nil, err
	}
	return dead, released, nil
}

// CountDeadLetters counts the dead letters f selects (its limit aside).
func CountDeadLetters(ctx context.Context, db Querier, f DeadLetterFilter) (int64, error) {
	where, args := f.where()
	var n int64
	if err := db.QueryRow(ctx, `SELECT count(*) FROM kfn.dead_letters WHERE `+where, args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("count dead letters: %w", err)
	}
	return n, nil
}

// purgeDeadLettersBatch is how many dead letters one DELETE of
// PurgeDeadLetters removes.
const purgeDeadLettersBatch = 1000

// PurgeDeadLetters deletes, in one transaction, every dead letter
// dead-lettered more than olderThan ago by the database's clock, and writes
// one audit row (action "purge", no partition: function and topic empty,
// partition -1) with their count, the cut-off time, the actor and the
// reason; none when there was nothing to delete. It returns the cut-off and
// the count. Like DiscardDeadLetters, it leaves the inbox alone, and it
// releases the keys the purged dead letters parked (ReleaseKeys).
func PurgeDeadLetters(ctx context.Context, db TxStarter, olderThan time.Duration, actor, reason string) (before time.Time, n int64, err error) {
	if olderThan <= 0 {
		return time.Time{}, 0, fmt.Errorf("purge dead letters: the age must be positive, not %s", olderThan)
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `SELECT now() - $1::interval`, olderThan).Scan(&before); err != nil {
			return err
		}
		for {
			// In batches: each statement stays short (a worker's sessions
			// have a statement timeout), the oldest rows first found.
			rows, err := tx.Query(ctx, `
DELETE FROM kfn.dead_letters WHERE id IN (SELECT id FROM kfn.dead_letters WHERE dead_at < $1 LIMIT $2)
RETURNING consumer, topic, partition, "offset"`, before, purgeDeadLettersBatch)
			if err != nil {
				return err
			}
			var refs []LetterRef
			var ref LetterRef
			_, err = pgx.ForEachRow(rows, []any{&ref.Partition.Consumer, &ref.Partition.Topic, &ref.Partition.Partition, &ref.Offset}, func() error {
				refs = append(refs, ref)
				return nil
			})
			if err != nil {
				return err
			}
			// A purged dead letter that parked its key releases it, as a
			// discard does: otherwise the key would wait for a letter no one
			// can retry any more.
			if _, err := ReleaseKeys(ctx, tx, actor, "purged", refs); err != nil {
				return err
			}
			n += int64(len(refs))
			if len(refs) < purgeDeadLettersBatch {
				break
			}
		}
		if n == 0 {
			return nil
		}
		return writeAudit(ctx, tx, actor, ActionPurge, Partition{Partition: -1}, map[string]any{
			"count": n, "before": before, "older_than": olderThan.String(), "reason": reason,
		})
	})
	if err != nil {
		return time.Time{}, 0, fmt.Errorf("purge dead letters older than %s: %w", olderThan, err)
	}
	return before, n, nil
}

// TxStarter begins transactions: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type TxStarter interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// rawMagic starts every raw record blob; the digit is the format version.
const rawMagic = "kfnraw1"

// EncodeRaw encodes a record's key, value and headers into one byte string
// that holds any byte and keeps null apart from empty. The format: the
// ASCII magic "kfnraw1", then the key, the value, the header count as an
// unsigned varint, and each header's name and value. Each byte field is an
// unsigned varint n followed by n-1 bytes, with n = 0 for null.
func EncodeRaw(key, value []byte, headers []Header) []byte {
	size := len(rawMagic) + len(key) + len(value) + 3*binary.MaxVarintLen64
	for _, h := range headers {
		size += len(h.Key) + len(h.Value) + 2*binary.MaxVarintLen64
	}
	out := make([]byte, 0, size)
	out = append(out, rawMagic...)
	field := func(b []byte) {
		if b == nil {
			out = binary.AppendUvarint(out, 0)
			return
		}
		out = binary.AppendUvarint(out, uint64(len(b))+1)
		out = append(out, b...)
	}
	field(key)
	field(value)
	out = binary.AppendUvarint(out, uint64(len(headers)))
	for _, h := range headers {
		field(nonNil(h.Key))
		field(h.Value)
	}
	return out
}

func varintLen(v uint64) int {
	var buf [binary.MaxVarintLen64]byte
	return binary.PutUvarint(buf[:], v)
}

// DecodeRaw reads a blob written by EncodeRaw.
func DecodeRaw(raw []byte) (key, value []byte, headers []Header, err error) {
	if len(raw) < len(rawMagic) || string(raw[:len(rawMagic)]) != rawMagic {
		return nil, nil, nil, errors.New("raw record: not in kfn's raw record encoding")
	}
	rest := raw[len(rawMagic):]
	bad := errors.New("raw record: truncated or corrupt")
	uvarint := func() (uint64, bool) {
		v, n := binary.Uvarint(rest)
		if n <= 0 || n != varintLen(v) { // overlong encodings are corrupt: one record, one encoding
			return 0, false
		}
		rest = rest[n:]
		return v, true
	}
	field := func() ([]byte, bool) {
		n, ok := uvarint()
		switch {
		case !ok:
			return nil, false
		case n == 0:
			return nil, true
		case n-1 > uint64(len(rest)):
			return nil, false
		}
		b := append([]byte{}, rest[:n-1]...)
		rest = rest[n-1:]
		return b, true
	}
	var ok bool
	if key, ok = field(); !ok {
		return nil, nil, nil, bad
	}
	if value, ok = field(); !ok {
		return nil, nil, nil, bad
	}
	count, ok := uvarint()
	if !ok || count > uint64(len(rest)) {
		return nil, nil, nil, bad
	}
	for i := uint64(0); i < count; i++ {
		var h Header
		if h.Key, ok = field(); !ok || h.Key == nil {
			return nil, nil, nil, bad
		}
		if h.Value, ok = field(); !ok {
			return nil, nil, nil, bad
		}
		headers = append(headers, h)
	}
	if len(rest) != 0 {
		return nil, nil, nil, bad
	}
	return key, value, headers, nil
}
