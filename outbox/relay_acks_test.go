package outbox

import (
	"errors"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The stream's answers as nats-server writes them (JSPubAckResponse), and
// what the relay reads from each.
func TestParsePubAck(t *testing.T) {
	cases := []struct {
		name      string
		msg       *nats.Msg
		duplicate bool
		errCode   int   // an *jetstream.APIError with this code
		err       error // or this error
	}{
		{name: "stored", msg: &nats.Msg{Data: []byte(`{"stream":"S","seq":7}`)}},
		{name: "stored in a domain", msg: &nats.Msg{Data: []byte(`{"stream":"S","seq":7,"domain":"hub"}`)}},
		{name: "duplicate", msg: &nats.Msg{Data: []byte(`{"stream":"S","seq":7,"duplicate":true}`)}, duplicate: true},
		{name: "duplicate, written by hand", msg: &nats.Msg{Data: []byte(`{"stream":"S","domain":"hub","seq":7,"duplicate": true}`)}, duplicate: true},
		{name: "not a duplicate", msg: &nats.Msg{Data: []byte(`{"stream":"S","seq":7,"duplicate": false}`)}},
		{name: "rejected", msg: &nats.Msg{Data: []byte(`{"error":{"code":400,"err_code":10054,"description":"maximum message size exceeded"}}`)}, errCode: 400},
		{name: "rejected, stream after the error", msg: &nats.Msg{Data: []byte(`{"error":{"code":503,"err_code":10077,"description":"resource limits exceeded for account"},"stream":"S","seq":0}`)}, errCode: 503},
		{name: "no stream listens", msg: &nats.Msg{Header: nats.Header{"Status": []string{"503"}}}, err: jetstream.ErrNoStreamResponse},
		{name: "other status", msg: &nats.Msg{Header: nats.Header{"Status": []string{"408"}, "Description": []string{"Request Timeout"}}}, err: jetstream.ErrInvalidJSAck},
		{name: "empty", msg: &nats.Msg{}, err: jetstream.ErrInvalidJSAck},
		{name: "not JSON", msg: &nats.Msg{Data: []byte(`+OK`)}, err: jetstream.ErrInvalidJSAck},
		{name: "no stream named", msg: &nats.Msg{Data: []byte(`{"seq":7}`)}, err: jetstream.ErrInvalidJSAck},
	}
	for _, tc := range cases {
		duplicate, err := parsePubAck(tc.msg)
		var apiErr *jetstream.APIError
		switch {
		case tc.errCode != 0:
			if !errors.As(err, &apiErr) || apiErr.Code != tc.errCode {
				t.Errorf("%s: error %v, want an API error with code %d", tc.name, err, tc.errCode)
			}
		case tc.err != nil:
			if !errors.Is(err, tc.err) {
				t.Errorf("%s: error %v, want %v", tc.name, err, tc.err)
			}
		case err != nil:
			t.Errorf("%s: error %v, want none", tc.name, err)
		}
		if duplicate != tc.duplicate {
			t.Errorf("%s: duplicate = %v, want %v", tc.name, duplicate, tc.duplicate)
		}
	}
}

// Reply subjects carry the shard (or the WAL slot reader's inbox, after
// the shards') and the sequence; anything else is not an ack of the relay's.
func TestAckRouterParsesReplySubjects(t *testing.T) {
	a := &ackRouter{prefix: "_INBOX.abc."}
	if shard, seq, ok := a.parseReply("_INBOX.abc.31.9001"); !ok || shard != 31 || seq != 9001 {
		t.Errorf("parseReply = %d, %d, %v; want 31, 9001, true", shard, seq, ok)
	}
	if shard, _, ok := a.parseReply("_INBOX.abc.32.1"); !ok || shard != walInbox {
		t.Errorf("parseReply of the WAL reader's reply = %d, %v; want %d, true", shard, ok, walInbox)
	}
	for _, bad := range []string{"_INBOX.abc.33.1", "_INBOX.abc.-1.1", "_INBOX.abc.3", "_INBOX.abc.3.x", "_INBOX.xyz.3.1", "_INBOX.abc."} {
		if _, _, ok := a.parseReply(bad); ok {
			t.Errorf("parseReply(%q) accepted it", bad)
		}
	}
}
