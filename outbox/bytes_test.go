package outbox

import (
	"bytes"
	"context"
	"encoding/base64"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// binaryKeys are event keys no text column or NATS header can carry as
// they are: a Confluent-framed key (magic byte 0x00 and a schema id), NUL,
// invalid UTF-8, a line break, and keys that differ only in such bytes.
var binaryKeys = []string{
	"\x00\x00\x00\x00\x2aorder-7",
	"\x00",
	"a\x00b",
	"a\x00c",
	"\xff\xfe\xfd",
	"line\r\nbreak",
	" padded ",
}

func TestBuildMessageCarriesABinaryKeyInBase64(t *testing.T) {
	t.Parallel()
	for _, key := range append([]string{"plain-key", "é ✓"}, binaryKeys...) {
		msg, _ := buildMessage(&relayRow{EventID: "id", Subject: "a.b", Type: "a.b", Key: key, Source: "fn"}, "S", CloudEventsSourcePrefix+"fn", nil)
		text, b64 := msg.Header.Get(HeaderKey), msg.Header.Get(HeaderKeyBase64)
		if ValidHeaderValue(key) {
			if text != key || msg.Header.Get(HeaderSubject) != key || b64 != "" {
				t.Errorf("key %q: kfn-key %q, ce-subject %q, kfn-key-b64 %q; want the key as text only", key, text, msg.Header.Get(HeaderSubject), b64)
			}
			continue
		}
		got, err := base64.StdEncoding.DecodeString(b64)
		if err != nil || string(got) != key || text != "" || msg.Header.Get(HeaderSubject) != "" {
			t.Errorf("key %q: kfn-key-b64 %q (decodes to %q, %v), kfn-key %q; want only the base64 of the key", key, b64, got, err, text)
		}
	}
	if ValidHeaderValue("\x00") || ValidHeaderValue("a\nb") || ValidHeaderValue("\xff") || ValidHeaderValue(" x") || !ValidHeaderValue("a b\tc") {
		t.Error("ValidHeaderValue misjudges")
	}
}

// TestOutboxStoresBinaryKeysAndTheRelayKeepsTheirOrder writes events with
// binary keys through Insert and relays them: the keys are stored byte for
// byte, shard by their bytes, reach the stream once each in per-key order,
// and a parked binary key holds back only its own events (the relay's
// in-flight filter compares bytea).
func TestOutboxStoresBinaryKeysAndTheRelayKeepsTheirOrder(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	rows := f.newRows(binaryKeys, 4)
	stuck := f.newRows([]string{"\x00stuck\xff"}, 3)
	stuck[1].Event.Subject = "outside." + f.subject // parks the key
	f.insert(append(append([]Row{}, stuck...), rows...))

	ctx := context.Background()
	dbRows, err := f.db.Pool.Query(ctx, `SELECT event_id, event_key, shard FROM kfn.outbox`)
	if err != nil {
		t.Fatal(err)
	}
	type stored struct {
		ID    string
		Key   []byte
		Shard int
	}
	got, err := pgx.CollectRows(dbRows, pgx.RowToStructByPos[stored])
	if err != nil {
		t.Fatal(err)
	}
	byID := map[string]Row{}
	for _, r := range append(append([]Row{}, stuck...), rows...) {
		byID[r.EventID] = r
	}
	for _, s := range got {
		r := byID[s.ID]
		if !bytes.Equal(s.Key, []byte(r.Event.Key)) || s.Shard != ShardOf(r.Event.Key) {
			t.Fatalf("event %s stored with key %q shard %d, want %q shard %d", s.ID, s.Key, s.Shard, r.Event.Key, ShardOf(r.Event.Key))
		}
	}

	cfg := f.config()
	cfg.ParkFor = 300 * time.Millisecond
	f.startRelay(cfg)
	want := len(rows) + 1 // the stuck key's first event gets through
	deadline := time.Now().Add(20 * time.Second)
	for f.streamMsgs() < want {
		if time.Now().After(deadline) {
			t.Fatalf("stream holds %d messages, want %d", f.streamMsgs(), want)
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(700 * time.Millisecond)
	if n := f.outboxCount(); n != len(stuck)-1 {
		t.Fatalf("outbox holds %d rows, want the parked binary key's %d", n, len(stuck)-1)
	}
	msgs := f.requireExactlyOnceInOrder(append([]Row{stuck[0]}, rows...))
	for _, m := range msgs {
		r := byID[m.Header.Get("Nats-Msg-Id")]
		key := m.Header.Get(HeaderKey)
		if b64 := m.Header.Get(HeaderKeyBase64); b64 != "" {
			k, _ := base64.StdEncoding.DecodeString(b64)
			key = string(k)
		}
		if key != r.Event.Key {
			t.Fatalf("message %s carries key %q, want %q", r.EventID, key, r.Event.Key)
		}
	}
}

func TestTraceContextValidation(t *testing.T) {
	t.Parallel()
	good := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	validParents := []string{
		good,
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
		"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",           // a future version
		"cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-ever", // future versions may add fields
	}
	invalidParents := []string{
		"",
		"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", // uppercase
		"00-00000000000000000000000000000000-00f067aa0ba902b7-01", // zero trace id
		"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", // zero parent id
		"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", // forbidden version
		good + "-extra",                // version 00 has exactly four fields
		good[:54],                      // short
		"00-abc-def-01",                // short fields
		good[:20] + "\x00" + good[21:], // NUL
		good[:20] + "\xff" + good[21:], // invalid UTF-8
		"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x", // future version, no dash after flags
		strings.Replace(good, "-", "_", 1),
	}
	for _, s := range validParents {
		if !ValidTraceParent(s) {
			t.Errorf("ValidTraceParent(%q) = false", s)
		}
	}
	for _, s := range invalidParents {
		if ValidTraceParent(s) {
			t.Errorf("ValidTraceParent(%q) = true", s)
		}
	}
	validStates := []string{
		"",
		"rojo=00f067aa0ba902b7",
		"rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
		" rojo=1 ,\tcongo=2 ,,",
		"tenant@vendor=v",
		"a/b*c_d-e=x y", // a value may hold inner spaces
		strings.TrimSuffix(strings.Repeat("k=v,", 1), ","),
	}
	var many []string
	for i := 0; i < 33; i++ {
		many = append(many, "k"+strings.Repeat("a", i)+"=v")
	}
	invalidStates := []string{
		"Rojo=1",                 // uppercase key
		"1abc=1",                 // a simple key starts with a letter
		"rojo",                   // no value
		"rojo=",                  // empty value
		"rojo=a,rojo=b",          // duplicate key
		"rojo=a=b",               // '=' in the value
		"rojo=a\x00",             // NUL
		"rojo=\xff",              // invalid UTF-8
		"rojo=é",                 // not ASCII
		"t@=v",                   // empty system id
		"t@vendorvendorvendor=v", // system id too long
		"rojo=" + strings.Repeat("v", 257),
		strings.Join(many, ","), // 33 members
	}
	for _, s := range validStates {
		if !ValidTraceState(s) {
			t.Errorf("ValidTraceState(%q) = false", s)
		}
	}
	for _, s := range invalidStates {
		if ValidTraceState(s) {
			t.Errorf("ValidTraceState(%q) = true", s)
		}
	}
}

// TestInsertPropagatesOnlyValidTraceContext: Insert copies an origin's
// trace context into the stored headers only when it is valid, and never
// overrides the event's own.
func TestInsertPropagatesOnlyValidTraceContext(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	rows := f.newRows([]string{"a", "b", "c", "d", "e", "f", "g"}, 1)
	rows[0].Origin.TraceParent, rows[0].Origin.TraceState = parent, "rojo=1"
	rows[1].Origin.TraceParent, rows[1].Origin.TraceState = parent, "rojo=\x00"     // state invalid: parent only
	rows[2].Origin.TraceParent, rows[2].Origin.TraceState = "00-\x00\xff", "rojo=1" // parent invalid: nothing
	rows[3].Origin.TraceParent = parent
	rows[3].Event.Headers = map[string]string{"traceparent": "00-11111111111111111111111111111111-2222222222222222-01"}
	rows[5].Origin.TraceParent, rows[5].Origin.Baggage = parent, "tenant=acme"
	rows[6].Origin.TraceParent, rows[6].Origin.Baggage = parent, "tenant=\x00" // baggage not header text: parent only
	f.insert(rows)
	want := []map[string]string{
		{"traceparent": parent, "tracestate": "rojo=1"},
		{"traceparent": parent},
		{},
		{"traceparent": "00-11111111111111111111111111111111-2222222222222222-01"},
		{},
		{"traceparent": parent, "baggage": "tenant=acme"},
		{"traceparent": parent},
	}
	for i, r := range rows {
		var headers map[string]string
		if err := f.db.Pool.QueryRow(context.Background(), `SELECT headers FROM kfn.outbox WHERE event_id = $1`, r.EventID).Scan(&headers); err != nil {
			t.Fatal(err)
		}
		if len(headers) != len(want[i]) {
			t.Errorf("row %d: headers %v, want %v", i, headers, want[i])
			continue
		}
		for k, v := range want[i] {
			if headers[k] != v {
				t.Errorf("row %d: headers %v, want %v", i, headers, want[i])
			}
		}
	}
}
