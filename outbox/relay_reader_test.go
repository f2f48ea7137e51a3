package outbox

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// keyOfShard returns a key (with prefix) whose events go to shard.
func keyOfShard(prefix string, shard int) string {
	for i := 0; ; i++ {
		if k := fmt.Sprintf("%s-%d", prefix, i); ShardOf(k) == shard {
			return k
		}
	}
}

// The reads of shard loops waiting at the same time are answered by one
// query, and each loop gets exactly its shard's rows: in id order, up to
// BatchSize, without its parked keys, with the relayed rows of every
// request deleted, and once even when its shard was asked twice.
func TestRelayReaderServesWaitingShardsWithOneQuery(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	cfg := f.config()
	cfg.BatchSize = 3
	relay, err := NewRelay(cfg)
	if err != nil {
		t.Fatal(err)
	}
	a, b, parked, c, d := keyOfShard("a", 1), keyOfShard("b", 2), keyOfShard("p", 2), keyOfShard("c", 3), keyOfShard("d", 4)
	f.insert(f.newRows([]string{a, parked, c, d}, 4))
	f.insert(f.newRows([]string{b}, 2))
	ids := map[string][]int64{}    // key → row ids in id order
	eventIDs := map[int64]string{} // row id → event id
	rows, err := f.db.Pool.Query(context.Background(), `SELECT id, event_id, event_key FROM kfn.outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		var eventID string
		var key []byte
		if err := rows.Scan(&id, &eventID, &key); err != nil {
			t.Fatal(err)
		}
		ids[string(key)] = append(ids[string(key)], id)
		eventIDs[id] = eventID
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}

	reqs := []readRequest{
		{shard: 1, relayed: ids[d]}, // shard 4's rows were relayed: deleted, by whichever request names them
		{shard: 2, parked: []string{parked}},
		{shard: 3},
		{shard: 3}, // a stopped loop's read, still queued as its successor's comes
	}
	for i := range reqs {
		reqs[i].reply = make(chan readReply, 1)
		relay.reads <- reqs[i]
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		relay.serveReads(ctx)
	}()
	replies := make([]readReply, len(reqs))
	for i, req := range reqs {
		replies[i] = <-req.reply
	}
	cancel()
	<-done

	if n := relay.Stats().Reads; n != 1 {
		t.Errorf("the reader ran %d queries for %d waiting reads, want 1", n, len(reqs))
	}
	want := []struct {
		ids  []int64
		full bool
	}{
		{ids[a][:3], true}, // BatchSize 3 of its 4 rows
		{ids[b], false},    // both of b, none of the parked key's (older) rows
		{ids[c][:3], true},
		{ids[c][:3], true},
	}
	for i, rep := range replies {
		if rep.err != nil {
			t.Fatalf("read of shard %d: %v", reqs[i].shard, rep.err)
		}
		var got []int64
		for _, r := range rep.rows {
			if r.Shard != reqs[i].shard || r.EventID != eventIDs[r.ID] {
				t.Errorf("read of shard %d returned row %d of shard %d, event %s (want event %s)", reqs[i].shard, r.ID, r.Shard, r.EventID, eventIDs[r.ID])
			}
			got = append(got, r.ID)
		}
		if !slices.Equal(got, want[i].ids) || rep.full != want[i].full {
			t.Errorf("read of shard %d returned rows %v (full %v), want %v (full %v)", reqs[i].shard, got, rep.full, want[i].ids, want[i].full)
		}
	}
	var left int
	if err := f.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kfn.outbox WHERE id = ANY($1)`, ids[d]).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("%d of the relayed rows are still in the outbox, want none", left)
	}
}
