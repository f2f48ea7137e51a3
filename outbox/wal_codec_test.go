package outbox

import (
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/pgdata"
)

// TestWALEventCarriesEveryByteOfTheRowAndBuildsTheSameMessage encodes rows
// with hostile keys, headers, subjects, topics and payloads and checks
// that the decoded event gives the message a table row gives: the same
// Nats-Msg-Id, subject, headers and data.
func TestWALEventCarriesEveryByteOfTheRowAndBuildsTheSameMessage(t *testing.T) {
	t.Parallel()
	created := time.Date(2026, 12, 4, 22, 0, 0, 123456000, time.UTC)
	origin := Origin{Consumer: "orders", Topic: "in\x00\xff topic", Partition: -1, Offset: 1 << 60, SourceID: "orders/3/7",
		TraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", TraceState: "a=b", Baggage: "k=v"}
	for i, key := range append([]string{"", "plain", "é ✓"}, binaryKeys...) {
		events := []Event{
			{Subject: "orders.accepted", Key: key, Data: []byte("\x00\xff{}\n")},
			{Subject: "orders.accepted", Type: "custom.type", Key: key, Data: nil, Headers: map[string]string{"x-a": "1", "": "empty name", "x-b": "line\r\nbreak", "Nats-Rollup": "all"}},
		}
		for j, ev := range events {
			row := NewRow(origin, i*10+j, "source-key", ev)
			want := relayRow{EventID: row.EventID, Subject: row.Event.Subject, Type: row.Event.Type, Key: row.Event.Key, Data: row.Event.Data,
				Headers: row.headers(), Source: origin.Consumer, SourceTopic: pgdata.Text(origin.Topic), SourcePartition: origin.Partition, SourceOffset: origin.Offset, CreatedAt: created}
			payload := encodeWALEvent(nil, row, created)
			got, err := decodeWALEvent(payload)
			if err != nil {
				t.Fatalf("key %q event %d: %v", key, j, err)
			}
			wantMsg, wantDropped := buildMessage(&want, "S", CloudEventsSourcePrefix+"orders", nil)
			gotMsg, gotDropped := buildMessage(&got, "S", CloudEventsSourcePrefix+"orders", nil)
			if gotMsg.Subject != wantMsg.Subject || string(gotMsg.Data) != string(wantMsg.Data) || len(gotDropped) != len(wantDropped) {
				t.Errorf("key %q event %d: message %q %q, want %q %q", key, j, gotMsg.Subject, gotMsg.Data, wantMsg.Subject, wantMsg.Data)
			}
			if !maps.EqualFunc(gotMsg.Header, wantMsg.Header, func(a, b []string) bool { return len(a) == 1 && len(b) == 1 && a[0] == b[0] }) {
				t.Errorf("key %q event %d: headers\n%v\nwant\n%v", key, j, gotMsg.Header, wantMsg.Header)
			}
			if got.Key != key && !(key == "" && got.Key == "source-key") {
				t.Errorf("key %q came back as %q", key, got.Key)
			}
			// Every cut of the payload is refused, never read as another event.
			for n := range len(payload) - len(row.Event.Data) {
				if _, err := decodeWALEvent(payload[:n]); !errors.Is(err, errWALPayload) {
					t.Fatalf("key %q event %d: a payload cut to %d of %d bytes decoded (%v)", key, j, n, len(payload), err)
				}
			}
		}
	}
}

func TestWALEventOfAnUnknownVersionIsRefused(t *testing.T) {
	t.Parallel()
	payload := encodeWALEvent(nil, NewRow(Origin{Consumer: "f", SourceID: "s"}, 0, "k", Event{Subject: "a.b"}), time.Now())
	payload[0] = walVersion + 1
	if _, err := decodeWALEvent(payload); !errors.Is(err, errWALPayload) {
		t.Fatalf("version %d decoded: %v", payload[0], err)
	}
}

func TestWALEventStoresACanonicalIDIn16Bytes(t *testing.T) {
	t.Parallel()
	row := NewRow(Origin{Consumer: "f", SourceID: "s"}, 0, "k", Event{Subject: "a.b"})
	short := encodeWALEvent(nil, row, time.Now())
	row.EventID = "not-a-uuid"
	long := encodeWALEvent(nil, row, time.Now())
	if got, err := decodeWALEvent(long); err != nil || got.EventID != "not-a-uuid" {
		t.Fatalf("a non-UUID id came back as %q (%v)", got.EventID, err)
	}
	if len(short) > 48 {
		t.Errorf("an event with a short subject and key takes %d bytes, want at most 48", len(short))
	}
}

func TestWALSlotNameIsAValidSlotNamePerDatabase(t *testing.T) {
	t.Parallel()
	seen := map[string]string{}
	for _, db := range []string{"kfn", "Orders-DB", "orders_db", "a" + string(make([]byte, 80)), "ünïcode"} {
		name := WALSlotName(db)
		if !slotNamePattern.MatchString(name) {
			t.Errorf("database %q: slot name %q is not a valid slot name", db, name)
		}
		if other, ok := seen[name]; ok {
			t.Errorf("databases %q and %q share slot %q", db, other, name)
		}
		seen[name] = db
	}
}

// TestWALEventDecodesInThreeAllocationsIntoCopies: the relay decodes every
// event it reads (not parallel: AllocsPerRun counts the whole process),
// and the walsender's buffer it reads from is reused, so nothing decoded
// may point into the payload.
func TestWALEventDecodesInThreeAllocationsIntoCopies(t *testing.T) {
	row := NewRow(Origin{Consumer: "orders", Topic: "in", SourceID: "orders/0/1"}, 0, "k", Event{Subject: "orders.accepted", Key: "customer-7", Data: []byte(`{"id":1}`)})
	payload := encodeWALEvent(nil, row, time.Now())
	if n := testing.AllocsPerRun(100, func() { decodeWALEvent(payload) }); n > 3 {
		t.Errorf("decoding an event without headers allocates %v times, want at most 3 (the id, the text, the data)", n)
	}
	got, err := decodeWALEvent(payload)
	if err != nil {
		t.Fatal(err)
	}
	want := got
	want.EventID, want.Subject, want.Key, want.Source = strings.Clone(got.EventID), strings.Clone(got.Subject), strings.Clone(got.Key), strings.Clone(got.Source)
	want.Data = slices.Clone(got.Data)
	for i := range payload {
		payload[i] = 'x'
	}
	if got.EventID != want.EventID || got.Subject != want.Subject || got.Key != want.Key || got.Source != want.Source || string(got.Data) != string(want.Data) {
		t.Errorf("the decoded event changed with its payload's buffer: %+v, was %+v", got, want)
	}
	if got.Key != "customer-7" || got.Subject != "orders.accepted" || got.EventID != row.EventID {
		t.Errorf("decoded %+v from %+v", got, row)
	}
}
