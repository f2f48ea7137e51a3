package outbox

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
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

// selectShardBatch reads the oldest rows of each of the shards $1.
//
// Why it cannot skip a row. It has no lower bound: no "id > last relayed id"
// cursor. Each read returns the lowest-id rows of a shard that are
// committed and still present, and a row leaves the table only when the
// stream has acked it. A transaction that took id 5 but commits after the
// one that took id 6 (ids come from a sequence, so commit order and id order
// differ) is therefore not passed over: the first read after its commit
// returns it, ahead of any higher id still present. A cursor-based relay
// loses exactly that row (watermill-sql did, and fixed it with xid8 and
// pg_snapshot_xmin); with no cursor there is nothing to fall behind. The
// txid column is not needed for this and the relay ignores it. A shard is
// also never read again before its previous batch is settled: every row of
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
// The range condition on shard (instead of "shard = r.shard") makes the
// planner read the (shard, id) index in order: with an equality it may
// instead walk the primary key in id order and filter on shard, which
// passes over every other shard's backlog. Parked keys ($2) are excluded
// whatever their shard: a key has one shard.
//
// The same statement deletes the rows of the previous batches that the
// stream acked ($3): no round trip of their own. Its SELECT sees the table
// as it was before the DELETE, so it leaves those ids out itself.
const selectShardBatch = `
WITH relayed AS (DELETE FROM kfn.outbox WHERE id = ANY($3::bigint[]))
SELECT o.shard, o.id, o.event_id, o.subject, o.event_type, o.event_key, o.data, o.headers,
       o.source, o.source_topic, o.source_partition, o.source_offset, o.created_at
FROM unnest($1::integer[]) AS r(shard)
CROSS JOIN LATERAL (
    SELECT * FROM kfn.outbox x
    WHERE x.shard >= r.shard AND x.shard <= r.shard
      AND NOT (x.event_key = ANY($2::bytea[]))
      AND NOT (x.id = ANY($3::bigint[]))
    ORDER BY x.shard, x.id
    LIMIT $4) o
ORDER BY o.shard, o.id`

// readShards deletes the rows the requests' shards relayed (acked by the
// stream), then reads up to limit rows of each request's shard in id
// order, leaving out the rows of parked keys, and appends them to the
// request's rows. scratch is reused from call to call.
func readShards(ctx context.Context, db *pgxpool.Pool, reqs []*readRequest, limit int, scratch *readScratch) error {
	shards := make([]int32, len(reqs))
	byShard := make(map[int32]*readRequest, len(reqs))
	parked := [][]byte{} // not nil: NULL would match no row
	relayed := []int64{}
	for i, req := range reqs {
		shards[i] = int32(req.shard)
		byShard[int32(req.shard)] = req
		for _, k := range req.parked {
			parked = append(parked, []byte(k))
		}
		relayed = append(relayed, req.relayed...)
	}
	// The extended protocol, whatever the pool's default: the simple one
	// would send every column as text.
	rows, err := db.Query(ctx, selectShardBatch, pgx.QueryExecModeCacheDescribe, relayResultFormats, shards, parked, relayed, limit)
	if err != nil {
		return fmt.Errorf("read outbox shards %v (after deleting %d relayed rows): %w", shards, len(relayed), err)
	}
	defer rows.Close()
	for i, f := range rows.FieldDescriptions() {
		if i >= len(relayResultFormats) || f.Format != relayResultFormats[i] {
			return fmt.Errorf("read outbox shards %v: column %s came in format %d, not the one asked for", shards, f.Name, f.Format)
		}
	}
	// The read's text columns and keys go into one string, its payloads
	// into one byte slice: two allocations per read instead of about ten
	// per row. The payloads get a fresh slice per read (a message keeps
	// its Data while its publish may be retried).
	texts, spans := scratch.texts[:0], scratch.spans[:0]
	blobs := make([]byte, 0, scratch.blobs)
	type placed struct {
		req *readRequest
		at  int
	}
	var where []placed
	for rows.Next() {
		raw := rows.RawValues()
		if len(raw) != 13 {
			return fmt.Errorf("read outbox shards %v: %d columns, want 13", shards, len(raw))
		}
		for _, v := range raw {
			if v == nil {
				return fmt.Errorf("read outbox shards %v: a NULL in a NOT NULL column", shards)
			}
		}
		if len(raw[0]) != 4 || len(raw[1]) != 8 || len(raw[10]) != 4 || len(raw[11]) != 8 || len(raw[12]) != 8 {
			return fmt.Errorf("read outbox shards %v: unexpected binary sizes of shard, id, source_partition, source_offset or created_at", shards)
		}
		req := byShard[int32(binary.BigEndian.Uint32(raw[0]))]
		if req == nil {
			return fmt.Errorf("read outbox shards %v: a row of shard %d, which was not asked for", shards, binary.BigEndian.Uint32(raw[0]))
		}
		var sp [7]span
		for i, col := range [6]int{2, 3, 4, 5, 8, 9} {
			sp[i] = span{len(texts), len(texts) + len(raw[col])}
			texts = append(texts, raw[col]...)
		}
		sp[6] = span{len(blobs), len(blobs) + len(raw[6])}
		blobs = append(blobs, raw[6]...)
		spans = append(spans, sp)
		where = append(where, placed{req, len(req.rows)})
		req.rows = append(req.rows, relayRow{
			ID:              int64(binary.BigEndian.Uint64(raw[1])),
			Headers:         decodeHeaders(raw[7]),
			SourcePartition: int32(binary.BigEndian.Uint32(raw[10])),
			SourceOffset:    int64(binary.BigEndian.Uint64(raw[11])),
			CreatedAt:       pgEpoch.Add(time.Duration(int64(binary.BigEndian.Uint64(raw[12]))) * time.Microsecond),
		})
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read outbox shards %v: %w", shards, err)
	}
	scratch.texts, scratch.spans, scratch.blobs = texts, spans, len(blobs)
	all := string(texts)
	text := func(s span) string { return all[s.from:s.to] }
	for i, sp := range spans {
		r := &where[i].req.rows[where[i].at]
		r.EventID, r.Subject, r.Type, r.Key = text(sp[0]), text(sp[1]), text(sp[2]), text(sp[3])
		r.Source, r.SourceTopic = text(sp[4]), text(sp[5])
		r.Data = blobs[sp[6].from:sp[6].to:sp[6].to]
	}
	return nil
}

// readScratch is readShards' memory from one read to the next: the text
// buffer and the row spans are reused, the payload buffer is sized like the
// last one.
type readScratch struct {
	texts []byte
	spans [][7]span // per row: event_id, subject, type, key, source, source_topic, data
	blobs int
}

type span struct{ from, to int }

// relayResultFormats asks for selectShardBatch's columns in the formats
// readShards decodes: integers and the timestamp in binary (big-endian;
// timestamptz as microseconds since pgEpoch), bytea in binary (its bytes),
// text and jsonb as text.
var relayResultFormats = pgx.QueryResultFormats{
	pgx.BinaryFormatCode,
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
