package inbox_test

import (
	"bytes"
	"context"
	"math/rand/v2"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// hostileDeadLetter is a record no text or jsonb column could hold: NUL and
// invalid UTF-8 in the key, the value, header names and values, duplicate
// and empty header names, a null header value, and an error that quotes the
// value.
func hostileDeadLetter(offset int64) inbox.DeadLetter {
	return inbox.DeadLetter{
		Partition: part, Offset: offset,
		Key:   []byte("\x00\x00\x00\x00\x07key"),
		Value: []byte("{\"a\":\x00\xff}"),
		Headers: []inbox.Header{
			{Key: []byte("trace\x00parent"), Value: []byte("\xff\xfe")},
			{Key: []byte("dup"), Value: []byte("1")},
			{Key: []byte("dup"), Value: []byte("2")},
			{Key: []byte{}, Value: []byte{}},
			{Key: []byte("\xc3("), Value: nil},
		},
		Reason: "permanent", Error: "permanent: decode JSON: invalid character '\x00' in string \xff", Attempts: 1,
	}
}

func requireSameRecord(t *testing.T, got, want inbox.DeadLetter) {
	t.Helper()
	if !bytes.Equal(got.Key, want.Key) || !bytes.Equal(got.Value, want.Value) {
		t.Errorf("offset %d: key %q value %q, want %q %q", want.Offset, got.Key, got.Value, want.Key, want.Value)
	}
	if (got.Key == nil) != (want.Key == nil) || (got.Value == nil) != (want.Value == nil) {
		t.Errorf("offset %d: null key/value not kept apart from empty: got %v/%v, want %v/%v", want.Offset, got.Key == nil, got.Value == nil, want.Key == nil, want.Value == nil)
	}
	if len(got.Headers) != len(want.Headers) {
		t.Fatalf("offset %d: %d headers, want %d: %q", want.Offset, len(got.Headers), len(want.Headers), got.Headers)
	}
	for i, h := range want.Headers {
		g := got.Headers[i]
		if !bytes.Equal(g.Key, h.Key) || !bytes.Equal(g.Value, h.Value) || (g.Value == nil) != (h.Value == nil) || g.Key == nil {
			t.Errorf("offset %d header %d = %q=%q (nil value %v), want %q=%q (nil value %v)", want.Offset, i, g.Key, g.Value, g.Value == nil, h.Key, h.Value, h.Value == nil)
		}
	}
}

func TestDeadLettersStoreEveryByte(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	want := hostileDeadLetter(7)
	var raw bool
	err := inTx(t, db, func(tx pgx.Tx) error {
		var err error
		raw, err = inbox.WriteDeadLetter(ctx, tx, want)
		return err
	})
	if err != nil || raw {
		t.Fatalf("WriteDeadLetter = %v (raw %v), want the row written column by column", err, raw)
	}
	dead, err := inbox.ListDeadLetters(ctx, db.Pool, part.Consumer, 10)
	if err != nil || len(dead) != 1 {
		t.Fatalf("ListDeadLetters = %d rows, %v", len(dead), err)
	}
	got := dead[0]
	requireSameRecord(t, got, want)
	if got.StoredRaw || got.ValueSize != int64(len(want.Value)) || got.ValueSHA256 != nil {
		t.Errorf("raw %v size %d sha %x, want a whole value of %d bytes stored by column", got.StoredRaw, got.ValueSize, got.ValueSHA256, len(want.Value))
	}
	if want := `permanent: decode JSON: invalid character '\x00' in string \xff`; got.Error != want {
		t.Errorf("error = %q, want %q", got.Error, want)
	}
	// The columns themselves hold the bytes (not some encoding of them).
	var key []byte
	var names, values [][]byte
	err = db.Pool.QueryRow(ctx, `SELECT record_key, header_keys, header_values FROM kfn.dead_letters`).Scan(&key, &names, &values)
	if err != nil || !bytes.Equal(key, want.Key) || len(names) != 5 || !bytes.Equal(names[0], []byte("trace\x00parent")) || values[4] != nil {
		t.Errorf("stored columns: key %q names %q values %q, %v", key, names, values, err)
	}
}

// TestDeadLetterFallsBackToARawBlob makes Postgres refuse the dead letter
// row with a data error (a CHECK constraint on the value, standing in for
// any column a record's bytes could break) and checks that the record is
// parked as one raw blob, in the same transaction, with its reason.
func TestDeadLetterFallsBackToARawBlob(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `ALTER TABLE kfn.dead_letters ADD CONSTRAINT no_poison CHECK (value IS NULL OR position('\x00ff'::bytea in value) = 0)`); err != nil {
		t.Fatal(err)
	}
	want := hostileDeadLetter(9) // its value holds 00 ff
	var raw bool
	err := inTx(t, db, func(tx pgx.Tx) error {
		if err := inbox.MarkDeadLettered(ctx, tx, part, 1, want.Offset); err != nil {
			return err
		}
		var err error
		raw, err = inbox.WriteDeadLetter(ctx, tx, want)
		return err
	})
	if err != nil || !raw {
		t.Fatalf("WriteDeadLetter = %v (raw %v), want a raw blob", err, raw)
	}
	var key, value, blob []byte
	var names [][]byte
	var reason string
	var inboxRows int
	err = db.Pool.QueryRow(ctx, `SELECT record_key, value, header_keys, raw, reason, (SELECT count(*) FROM kfn.inbox) FROM kfn.dead_letters`).
		Scan(&key, &value, &names, &blob, &reason, &inboxRows)
	if err != nil {
		t.Fatal(err)
	}
	if key != nil || value != nil || names != nil || len(blob) == 0 || reason != "permanent" || inboxRows != 1 {
		t.Fatalf("blob row: key %q value %q headers %q raw %d bytes reason %q, inbox rows %d; want only raw set, reason kept, the inbox row committed",
			key, value, names, len(blob), reason, inboxRows)
	}
	dead, err := inbox.ListDeadLetters(ctx, db.Pool, part.Consumer, 10)
	if err != nil || len(dead) != 1 || !dead[0].StoredRaw {
		t.Fatalf("ListDeadLetters = %+v, %v; want one decoded raw dead letter", dead, err)
	}
	requireSameRecord(t, dead[0], want)
	if !bytes.Contains([]byte(dead[0].Error), []byte("raw blob")) || !bytes.Contains([]byte(dead[0].Error), []byte("no_poison")) {
		t.Errorf("error %q does not say the record was stored raw and why", dead[0].Error)
	}
}

func TestRawRecordEncodingRoundTrips(t *testing.T) {
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	blob := func() []byte {
		switch rng.IntN(5) {
		case 0:
			return nil
		case 1:
			return []byte{}
		}
		b := make([]byte, rng.IntN(300))
		for i := range b {
			b[i] = byte(rng.UintN(256))
		}
		return b
	}
	for i := 0; i < 2000; i++ {
		want := inbox.DeadLetter{Offset: int64(i), Key: blob(), Value: blob()}
		for range rng.IntN(6) {
			k := blob()
			if k == nil {
				k = []byte{}
			}
			want.Headers = append(want.Headers, inbox.Header{Key: k, Value: blob()})
		}
		enc := inbox.EncodeRaw(want.Key, want.Value, want.Headers)
		var got inbox.DeadLetter
		var err error
		got.Key, got.Value, got.Headers, err = inbox.DecodeRaw(enc)
		if err != nil {
			t.Fatalf("record %d: %v", i, err)
		}
		requireSameRecord(t, got, want)
		if t.Failed() {
			t.FailNow()
		}
		// Every strict prefix is refused, never mis-decoded or a panic.
		cut := rng.IntN(len(enc))
		if _, _, _, err := inbox.DecodeRaw(enc[:cut]); err == nil {
			t.Fatalf("record %d: a %d-byte prefix of its %d-byte encoding decoded", i, cut, len(enc))
		}
	}
}

func FuzzDecodeRaw(f *testing.F) {
	f.Add(inbox.EncodeRaw([]byte("k"), nil, []inbox.Header{{Key: []byte("h"), Value: []byte{0}}}))
	f.Add([]byte("kfnraw1\x00\x00\x05"))
	f.Fuzz(func(t *testing.T, data []byte) {
		key, value, headers, err := inbox.DecodeRaw(data)
		if err != nil {
			return
		}
		again := inbox.EncodeRaw(key, value, headers)
		if !bytes.Equal(again, data) {
			t.Fatalf("decode then encode of %q gave %q", data, again)
		}
	})
}
