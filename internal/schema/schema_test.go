package schema_test

import (
	"bytes"
	"context"
	"encoding/json"
	"slices"
	"testing"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

// legacyHeader is how schema version 4 stored a dead letter header: Go's
// JSON encoding of {Key string; Value []byte}, the value in base64.
type legacyHeader struct {
	Key   string `json:"key"`
	Value []byte `json:"value"`
}

// TestMigration5MovesRecordDataToBytes migrates a database at version 4
// holding dead letters (headers in jsonb) and outbox rows (text keys) and
// checks that the data reads back byte for byte from the new columns.
func TestMigration5MovesRecordDataToBytes(t *testing.T) {
	db := kfntest.PostgresEmpty(t)
	ctx := context.Background()
	if _, err := schema.MigrateTo(ctx, db.Pool, 4); err != nil {
		t.Fatal(err)
	}
	if v, err := schema.Version(ctx, db.Pool); err != nil || v != 4 {
		t.Fatalf("version = %d, %v; want 4", v, err)
	}

	headers := []legacyHeader{
		{Key: "traceparent", Value: []byte("00-abc")},
		{Key: "dup", Value: []byte{0, 0xff, 1}},
		{Key: "dup", Value: []byte{}},
		{Key: "nullv", Value: nil},
		{Key: "é", Value: []byte("x")},
	}
	legacy, err := json.Marshal(headers)
	if err != nil {
		t.Fatal(err)
	}
	insert := `INSERT INTO kfn.dead_letters (consumer, topic, partition, "offset", record_key, value, headers, reason, error, attempts)
	           VALUES ('fn', 'orders', 0, $1, $2, $3, $4, 'permanent', 'bad', 1)`
	for _, row := range []struct {
		offset     int64
		key, value []byte
		headers    string
	}{
		{1, []byte("k1"), []byte("v1"), string(legacy)},
		{2, nil, nil, `[]`},
	} {
		if _, err := db.Pool.Exec(ctx, insert, row.offset, row.key, row.value, row.headers); err != nil {
			t.Fatal(err)
		}
	}
	_, err = db.Pool.Exec(ctx, `INSERT INTO kfn.outbox (event_id, subject, event_type, event_key, shard, data, source, source_topic, source_partition, source_offset)
	                            VALUES ('e1', 's', 's', 'clé-1', 3, '\x01', 'fn', 'orders', 0, 1)`)
	if err != nil {
		t.Fatal(err)
	}

	applied, err := schema.Migrate(ctx, db.Pool)
	var want []int // 5 and every later version
	for _, m := range schema.Migrations() {
		if m.Version >= 5 {
			want = append(want, m.Version)
		}
	}
	if err != nil || !slices.Equal(applied, want) {
		t.Fatalf("Migrate = %v, %v; want %v applied", applied, err, want)
	}
	if err := schema.Check(ctx, db.Pool); err != nil {
		t.Fatalf("Check after migrating: %v", err)
	}

	dead, err := inbox.ListDeadLetters(ctx, db.Pool, "fn", 10)
	if err != nil || len(dead) != 2 {
		t.Fatalf("ListDeadLetters = %d rows, %v", len(dead), err)
	}
	d := dead[0]
	if string(d.Key) != "k1" || string(d.Value) != "v1" || d.ValueSize != 2 || d.StoredRaw || len(d.Headers) != len(headers) {
		t.Fatalf("migrated dead letter = %+v", d)
	}
	for i, h := range headers {
		g := d.Headers[i]
		if string(g.Key) != h.Key || !bytes.Equal(g.Value, h.Value) || (g.Value == nil) != (h.Value == nil) {
			t.Errorf("header %d = %q=%q (nil %v), want %q=%q (nil %v)", i, g.Key, g.Value, g.Value == nil, h.Key, h.Value, h.Value == nil)
		}
	}
	if d := dead[1]; d.Key != nil || d.Value != nil || len(d.Headers) != 0 || d.ValueSize != 0 {
		t.Errorf("migrated dead letter without key, value or headers = %+v", d)
	}
	var key []byte
	if err := db.Pool.QueryRow(ctx, `SELECT event_key FROM kfn.outbox`).Scan(&key); err != nil || string(key) != "clé-1" {
		t.Errorf("migrated outbox key = %q, %v; want the UTF-8 bytes of clé-1", key, err)
	}
	// The new columns take what the old ones refused.
	_, err = db.Pool.Exec(ctx, `INSERT INTO kfn.outbox (event_id, subject, event_type, event_key, shard, data, source, source_topic, source_partition, source_offset)
	                            VALUES ('e2', 's', 's', '\x00ff', 3, '\x01', 'fn', 'orders', 0, 2)`)
	if err != nil {
		t.Errorf("outbox refuses a binary key after the migration: %v", err)
	}
}
