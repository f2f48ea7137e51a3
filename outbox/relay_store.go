package outbox

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
)

// relayRow is one committed outbox row as the relay reads it.
type relayRow struct {
	ID              int64
	EventID         string
	Subject         string
	Type            string
	Key             string // any bytes: event_key is bytea
	Data            []byte
	Headers         map[string]string
	Source          string
	SourceTopic     string
	SourcePartition int32
	SourceOffset    int64
	CreatedAt       time.Time
}

// selectShardBatch reads the oldest rows of one shard.
//
// Why it cannot skip a row. It has no lower bound: no "id > last relayed id"
// cursor. Each read returns the lowest-id rows of the shard that are
// committed and still present, and a row leaves the table only when the
// stream has acked it. A transaction that took id 5 but commits after the
// one that took id 6 (ids come from a sequence, so commit order and id order
// differ) is therefore not passed over: the first read after its commit
// returns it, ahead of any higher id still present. A cursor-based relay
// loses exactly that row (watermill-sql did, and fixed it with xid8 and
// pg_snapshot_xmin); with no cursor there is nothing to fall behind. The
// txid column is not needed for this and the relay ignores it. The caller
// also never reads again before the previous batch is settled: every row of
// it is deleted (acked) or belongs to a parked key, which this query
// excludes, so no exclusion list of in-flight ids is needed.
//
// Why a long transaction does not stall it. It has no snapshot bound either
// (no "txid < pg_snapshot_xmin(pg_current_snapshot())"), so a long-running
// or idle-in-transaction session elsewhere in the database never holds rows
// back. The price is the order among transactions that were open at the
// same time: rows go out in the order they become visible, which is commit
// order, and id order among rows that became visible together. For one key
// that is the order its writer committed them, which is the order that
// matters (a partition's transactions commit one after another).
//
// The range condition on shard (instead of "shard = $1") makes the planner
// read the (shard, id) index in order: with an equality it may instead walk
// the primary key in id order and filter on shard, which passes over every
// other shard's backlog.
//
// The same statement deletes the rows of the previous batch that the
// stream acked ($4): one round trip per batch instead of two. Its SELECT
// sees the table as it was before the DELETE, so it leaves those ids out
// itself.
//
// That delete commits without waiting for the WAL flush: set_config(…,
// true) turns synchronous_commit off for the statement's own transaction,
// once it finds a row to delete. Nothing else in the session changes. A
// synchronous delete made every read of a shard wait for an fsync (13.7 ms
// of a read's 14 ms at the median in BenchmarkRelay on this class of
// machine), and its flushes competed with the functions' commits. What
// the lazy commit risks is a Postgres crash in the moment (at most about
// 3 × wal_writer_delay) before the flush: the deletes of that suffix of the
// WAL are lost and their rows come back. That is the state a relay crash
// between the ack and the delete leaves, which the relay is built for: the
// rows are sent again in id order, the stream's duplicate window drops
// them, and a kfn function's event inbox drops any that come later. A row
// whose delete is lost was acked, so nothing is lost either way, and a
// later durable commit (any function's) flushes the deletes before it.
const selectShardBatch = `
WITH relayed AS (
  DELETE FROM kfn.outbox
  WHERE id = ANY($4::bigint[])
    AND set_config('synchronous_commit', 'off', true) IS NOT NULL)
SELECT id, event_id, subject, event_type, event_key, data, headers,
       source, source_topic, source_partition, source_offset, created_at
FROM kfn.outbox
WHERE shard >= $1 AND shard <= $1
  AND NOT (event_key = ANY($2::bytea[]))
  AND NOT (id = ANY($4::bigint[]))
ORDER BY shard, id
LIMIT $3`

// readBatch deletes the rows relayed (acked by the stream), then returns up
// to limit rows of the shard in id order, leaving out the rows of the
// parked keys, appended to out. scratch is reused from call to call.
func readBatch(ctx context.Context, db *pgxpool.Pool, shard int, parkedKeys []string, limit int, relayed []int64, out []relayRow, scratch *readScratch) ([]relayRow, error) {
	parked := make([][]byte, len(parkedKeys)) // not nil: NULL would match no row
	for i, k := range parkedKeys {
		parked[i] = []byte(k)
	}
	if relayed == nil {
		relayed = []int64{}
	}
	// The extended protocol, whatever the pool's default: the simple one
	// would send every column as text.
	rows, err := db.Query(ctx, selectShardBatch, pgx.QueryExecModeCacheDescribe, relayResultFormats, shard, parked, limit, relayed)
	if err != nil {
		return nil, fmt.Errorf("read outbox shard %d (after deleting %d relayed rows): %w", shard, len(relayed), err)
	}
	defer rows.Close()
	for i, f := range rows.FieldDescriptions() {
		if i >= len(relayResultFormats) || f.Format != relayResultFormats[i] {
			return nil, fmt.Errorf("read outbox shard %d: column %s came in format %d, not the one asked for", shard, f.Name, f.Format)
		}
	}
	first := len(out)
	// The batch's text columns and keys go into one string, its payloads
	// into one byte slice: two allocations per batch instead of about ten
	// per row. The payloads get a fresh slice per batch (a message keeps
	// its Data while its publish may be retried).
	texts, spans := scratch.texts[:0], scratch.spans[:0]
	blobs := make([]byte, 0, scratch.blobs)
	for rows.Next() {
		raw := rows.RawValues()
		if len(raw) != 12 {
			return nil, fmt.Errorf("read outbox shard %d: %d columns, want 12", shard, len(raw))
		}
		for _, v := range raw {
			if v == nil {
				return nil, fmt.Errorf("read outbox shard %d: a NULL in a NOT NULL column", shard)
			}
		}
		if len(raw[0]) != 8 || len(raw[9]) != 4 || len(raw[10]) != 8 || len(raw[11]) != 8 {
			return nil, fmt.Errorf("read outbox shard %d: unexpected binary sizes of id, source_partition, source_offset or created_at", shard)
		}
		var sp [7]span
		for i, col := range [6]int{1, 2, 3, 4, 7, 8} {
			sp[i] = span{len(texts), len(texts) + len(raw[col])}
			texts = append(texts, raw[col]...)
		}
		sp[6] = span{len(blobs), len(blobs) + len(raw[5])}
		blobs = append(blobs, raw[5]...)
		spans = append(spans, sp)
		out = append(out, relayRow{
			ID:              int64(binary.BigEndian.Uint64(raw[0])),
			Headers:         decodeHeaders(raw[6]),
			SourcePartition: int32(binary.BigEndian.Uint32(raw[9])),
			SourceOffset:    int64(binary.BigEndian.Uint64(raw[10])),
			CreatedAt:       pgEpoch.Add(time.Duration(int64(binary.BigEndian.Uint64(raw[11]))) * time.Microsecond),
		})
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read outbox shard %d: %w", shard, err)
	}
	scratch.texts, scratch.spans, scratch.blobs = texts, spans, len(blobs)
	all := string(texts)
	text := func(s span) string { return all[s.from:s.to] }
	for i, sp := range spans {
		r := &out[first+i]
		r.EventID, r.Subject, r.Type, r.Key = text(sp[0]), text(sp[1]), text(sp[2]), text(sp[3])
		r.Source, r.SourceTopic = text(sp[4]), text(sp[5])
		r.Data = blobs[sp[6].from:sp[6].to:sp[6].to]
	}
	return out, nil
}

// readScratch is readBatch's memory from one batch to the next: the text
// buffer and the row spans are reused, the payload buffer is sized like the
// last one.
type readScratch struct {
	texts []byte
	spans [][7]span // per row: event_id, subject, type, key, source, source_topic, data
	blobs int
}

type span struct{ from, to int }

// relayResultFormats asks for selectShardBatch's columns in the formats
// readBatch decodes: integers and the timestamp in binary (big-endian;
// timestamptz as microseconds since pgEpoch), bytea in binary (its bytes),
// text and jsonb as text.
var relayResultFormats = pgx.QueryResultFormats{
	pgx.BinaryFormatCode, pgx.TextFormatCode, pgx.TextFormatCode, pgx.TextFormatCode,
	pgx.BinaryFormatCode, pgx.BinaryFormatCode, pgx.TextFormatCode,
	pgx.TextFormatCode, pgx.TextFormatCode, pgx.BinaryFormatCode, pgx.BinaryFormatCode, pgx.BinaryFormatCode,
}

// pgEpoch is the zero of Postgres's binary timestamps.
var pgEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// deleteRelayed removes rows the stream has acked.
func deleteRelayed(ctx context.Context, db *pgxpool.Pool, ids []int64) error {
	if len(ids) == 0 {
		return nil
	}
	if _, err := db.Exec(ctx, `DELETE FROM kfn.outbox WHERE id = ANY($1::bigint[])`, ids); err != nil {
		return fmt.Errorf("delete %d relayed outbox rows: %w", len(ids), err)
	}
	return nil
}

// decodeHeaders reads the headers column. Insert stores a JSON object of
// strings; a row written by hand with other JSON values keeps them as their
// JSON text rather than stalling the relay.
func decodeHeaders(raw []byte) map[string]string {
	if len(raw) == 0 || string(raw) == "{}" { // most events have none
		return nil
	}
	var h map[string]string
	if err := json.Unmarshal(raw, &h); err == nil {
		return h
	}
	var loose map[string]json.RawMessage
	if err := json.Unmarshal(raw, &loose); err != nil {
		return nil
	}
	h = make(map[string]string, len(loose))
	for k, v := range loose {
		var s string
		if json.Unmarshal(v, &s) == nil {
			h[k] = s
		} else {
			h[k] = string(v)
		}
	}
	return h
}

// Pending is an outbox row not yet relayed, with the message the relay
// publishes for it.
type Pending struct {
	ID  int64     // the row's id: delete it once the stream has acked Msg
	Msg *nats.Msg // the message for the relay's stream, as buildMessage makes it
}

// ReadPending reads the limit oldest outbox rows, of every shard and of
// parked keys too, each with the message the relay publishes for it to
// stream. It is for a tool that relays rows one at a time by itself (the
// naive relay kfn bench measures the relay against); the relay itself
// reads a shard at a time (readBatch).
func ReadPending(ctx context.Context, db *pgxpool.Pool, stream string, limit int) ([]Pending, error) {
	rows, err := db.Query(ctx, `SELECT id, event_id, subject, event_type, event_key, data, headers,
			source, source_topic, source_partition, source_offset, created_at FROM kfn.outbox ORDER BY id LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("read pending outbox rows: %w", err)
	}
	batch, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (relayRow, error) {
		var row relayRow
		var key, headers []byte
		err := r.Scan(&row.ID, &row.EventID, &row.Subject, &row.Type, &key, &row.Data, &headers,
			&row.Source, &row.SourceTopic, &row.SourcePartition, &row.SourceOffset, &row.CreatedAt)
		row.Key, row.Headers = string(key), decodeHeaders(headers)
		return row, err
	})
	if err != nil {
		return nil, fmt.Errorf("read pending outbox rows: %w", err)
	}
	pending := make([]Pending, len(batch))
	for i := range batch {
		msg, _ := buildMessage(&batch[i], stream, CloudEventsSourcePrefix+batch[i].Source, nil)
		pending[i] = Pending{ID: batch[i].ID, Msg: msg}
	}
	return pending, nil
}
