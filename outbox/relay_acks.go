package outbox

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ackRouter publishes a relay's messages with core NATS and takes the
// stream's acks on one subscription of its own, which hands each ack to its
// shard's loop by the reply subject (prefix + shard + "." + sequence). It
// does what jetstream's PublishMsgAsync does for the relay, without a
// future, a map entry and channels per message and without decoding the ack
// as JSON (parsePubAck): at full load that bookkeeping and the JSON were
// about a fifth of the relay's CPU.
//
// When the connection goes down (reconnecting or closed), every publish
// sent before is told it lost its ack, as PublishMsgAsync's futures are:
// the shards send those events again once NATS is back, and the stream's
// duplicate window drops the ones it had stored.
type ackRouter struct {
	nc *nats.Conn
	// publish sends a message; tests replace it (RelayConfig.publish).
	publish func(*nats.Conn, *nats.Msg) error
	prefix  string
	seq     atomic.Uint64        // the last reply sequence handed out, over all shards
	inbox   [Shards + 1]ackInbox // per shard, then the WAL slot reader's (walInbox)
	sub     *nats.Subscription
	status  chan nats.Status
}

// ackInbox holds the acks of one shard's publishes until its loop takes
// them; ready signals that there are some.
type ackInbox struct {
	mu      sync.Mutex
	results []ackResult
	ready   chan struct{}
}

// ackResult is the stream's answer to the publish with reply sequence seq,
// or, with lost, the news that every publish up to seq lost its ack.
type ackResult struct {
	seq       uint64
	lost      bool
	duplicate bool
	err       error
}

// newAckRouter subscribes to the relay's reply subjects and watches the
// connection. The subscription's goroutine, which reads the acks, inherits
// the caller's pprof labels.
func newAckRouter(nc *nats.Conn, publish func(*nats.Conn, *nats.Msg) error) (*ackRouter, error) {
	a := &ackRouter{nc: nc, publish: publish, prefix: nc.NewRespInbox() + "."}
	if a.publish == nil {
		a.publish = (*nats.Conn).PublishMsg
	}
	for i := range a.inbox {
		a.inbox[i].ready = make(chan struct{}, 1)
	}
	a.status = nc.StatusChanged(nats.RECONNECTING, nats.CLOSED)
	sub, err := nc.Subscribe(a.prefix+"*.*", a.handle)
	if err != nil {
		nc.RemoveStatusListener(a.status)
		return nil, fmt.Errorf("subscribe to the relay's stream acks: %w", err)
	}
	a.sub = sub
	go a.watch(a.status)
	return a, nil
}

// close ends the subscription and the watch on the connection; acks still
// on their way are dropped (their rows stay in the outbox).
func (a *ackRouter) close() {
	a.sub.Unsubscribe() //nolint:errcheck // a closed connection has dropped it already
	a.nc.RemoveStatusListener(a.status)
}

// send publishes msg for shard with a reply subject of its own and returns
// the reply sequence its ack will carry.
func (a *ackRouter) send(shard int, msg *nats.Msg) (uint64, error) {
	seq := a.seq.Add(1)
	var buf [96]byte
	reply := append(buf[:0], a.prefix...)
	reply = strconv.AppendInt(reply, int64(shard), 10)
	reply = append(reply, '.')
	reply = strconv.AppendUint(reply, seq, 10)
	msg.Reply = string(reply)
	return seq, a.publish(a.nc, msg)
}

// handle routes one ack to its shard.
func (a *ackRouter) handle(m *nats.Msg) {
	shard, seq, ok := a.parseReply(m.Subject)
	if !ok {
		return
	}
	duplicate, err := parsePubAck(m)
	a.inbox[shard].post(ackResult{seq: seq, duplicate: duplicate, err: err})
}

// watch tells every shard that its publishes so far lost their acks each
// time the connection drops, until it closes or the router does.
func (a *ackRouter) watch(status <-chan nats.Status) {
	for s := range status {
		upTo := a.seq.Load()
		for i := range a.inbox {
			a.inbox[i].post(ackResult{seq: upTo, lost: true, err: nats.ErrDisconnected})
		}
		if s == nats.CLOSED {
			return
		}
	}
}

// parseReply reads the shard and the sequence out of a reply subject.
func (a *ackRouter) parseReply(subject string) (int, uint64, bool) {
	if len(subject) <= len(a.prefix) || subject[:len(a.prefix)] != a.prefix {
		return 0, 0, false
	}
	rest := subject[len(a.prefix):]
	dot := strings.IndexByte(rest, '.')
	if dot < 0 {
		return 0, 0, false
	}
	shard, err := strconv.Atoi(rest[:dot])
	if err != nil || shard < 0 || shard > walInbox {
		return 0, 0, false
	}
	seq, err := strconv.ParseUint(rest[dot+1:], 10, 64)
	if err != nil {
		return 0, 0, false
	}
	return shard, seq, true
}

func (in *ackInbox) post(r ackResult) {
	in.mu.Lock()
	in.results = append(in.results, r)
	in.mu.Unlock()
	select {
	case in.ready <- struct{}{}:
	default:
	}
}

// take returns the acks that came in and leaves spare, emptied, in their
// place.
func (in *ackInbox) take(spare []ackResult) []ackResult {
	in.mu.Lock()
	got := in.results
	in.results = spare[:0]
	in.mu.Unlock()
	return got
}

// The shape of a JetStream publish ack (nats-server's JSPubAckResponse): on
// success {"stream":"S","seq":N} with "domain" and "duplicate":true when
// they apply (the server writes some by hand, as `"duplicate": true`); on
// failure {"error":{"code":…,"err_code":…,"description":…}} first, perhaps
// followed by the stream.
var (
	ackSuccessPrefix = []byte(`{"stream":`)
	ackErrorField    = []byte(`"error"`)
	ackDuplicate     = []byte(`"duplicate":`)
	jsonTrue         = []byte("true")
)

// parsePubAck reads a stream's answer to a publish: whether the stream
// already had the message (its Nats-Msg-Id inside the duplicate window), or
// why it was not stored. A success, which stream and domain names cannot
// fake (they hold no quotes), is read without JSON decoding; anything else
// is decoded in full. An empty message with status 503 means no stream
// listens on the subject (jetstream.ErrNoStreamResponse).
func parsePubAck(m *nats.Msg) (duplicate bool, err error) {
	if len(m.Data) == 0 {
		if status := m.Header.Get("Status"); status == "503" {
			return false, jetstream.ErrNoStreamResponse
		} else if status != "" {
			return false, fmt.Errorf("%w: status %s %s", jetstream.ErrInvalidJSAck, status, m.Header.Get("Description"))
		}
		return false, jetstream.ErrInvalidJSAck
	}
	if bytes.HasPrefix(m.Data, ackSuccessPrefix) && !bytes.Contains(m.Data, ackErrorField) {
		i := bytes.Index(m.Data, ackDuplicate)
		return i >= 0 && bytes.HasPrefix(bytes.TrimLeft(m.Data[i+len(ackDuplicate):], " \t\r\n"), jsonTrue), nil
	}
	var resp struct {
		Error     *jetstream.APIError `json:"error"`
		Stream    string              `json:"stream"`
		Duplicate bool                `json:"duplicate"`
	}
	if err := json.Unmarshal(m.Data, &resp); err != nil {
		return false, fmt.Errorf("%w: %v", jetstream.ErrInvalidJSAck, err)
	}
	switch {
	case resp.Error != nil:
		return false, resp.Error
	case resp.Stream == "":
		return false, jetstream.ErrInvalidJSAck
	}
	return resp.Duplicate, nil
}
