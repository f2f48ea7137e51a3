package inbox

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
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
	Reason     string // short machine-friendly cause: handler_error, permanent, panic, oversized, timeout, data_error
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

// ListDeadLetters returns the dead letters of a consumer, oldest first. A
// dead letter stored as a raw blob comes back decoded, with StoredRaw set.
func ListDeadLetters(ctx context.Context, db Querier, consumer string, limit int) ([]DeadLetter, error) {
	rows, err := db.Query(ctx, `
SELECT id, consumer, topic, partition, "offset", record_key, value, header_keys, header_values,
       coalesce(value_size, 0), value_sha256, raw, coalesce(record_time, 'epoch'), reason, error, attempts, dead_at
  FROM kfn.dead_letters WHERE consumer = $1 OR $1 = '' ORDER BY id LIMIT $2`, consumer, limit)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadLetter, error) {
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
