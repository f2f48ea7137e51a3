package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

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
const selectShardBatch = `
WITH relayed AS (DELETE FROM kfn.outbox WHERE id = ANY($4::bigint[]))
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
// parked keys, appended to out.
func readBatch(ctx context.Context, db *pgxpool.Pool, shard int, parkedKeys []string, limit int, relayed []int64, out []relayRow) ([]relayRow, error) {
	parked := make([][]byte, len(parkedKeys)) // not nil: NULL would match no row
	for i, k := range parkedKeys {
		parked[i] = []byte(k)
	}
	if relayed == nil {
		relayed = []int64{}
	}
	rows, err := db.Query(ctx, selectShardBatch, shard, parked, limit, relayed)
	if err != nil {
		return nil, fmt.Errorf("read outbox shard %d (after deleting %d relayed rows): %w", shard, len(relayed), err)
	}
	defer rows.Close()
	for rows.Next() {
		var r relayRow
		var key, headers []byte
		if err := rows.Scan(&r.ID, &r.EventID, &r.Subject, &r.Type, &key, &r.Data, &headers,
			&r.Source, &r.SourceTopic, &r.SourcePartition, &r.SourceOffset, &r.CreatedAt); err != nil {
			return nil, fmt.Errorf("read outbox shard %d: scan: %w", shard, err)
		}
		r.Key = string(key)
		r.Headers = decodeHeaders(headers)
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read outbox shard %d: %w", shard, err)
	}
	return out, nil
}

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
