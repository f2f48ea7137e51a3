package naming

import (
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/pgdata"
	"github.com/kfn-dev/kfn/outbox"
)

// LaneConsumer is the durable JetStream consumer of a lane: the function's
// name when it has one lane (as before lanes existed), else one name per
// lane and lane count, so that a change of the count starts fresh
// consumers at the new lanes' cursors.
func LaneConsumer(fn string, lane, lanes int) string {
	if lanes == 1 {
		return fn
	}
	return fmt.Sprintf("%s_lane%dof%d", fn, lane, lanes)
}

// EventID is the id a NATS-triggered function's event inbox knows the
// event at stream sequence seq by: its Nats-Msg-Id (storable, see
// storableEventID), or its stream position when it has none.
func EventID(h nats.Header, stream string, seq int64) string {
	return EventIDOf(h.Get(jetstream.MsgIDHeader), stream, seq)
}

// EventIDOf is EventID for an event whose Nats-Msg-Id is msgID ("" when
// it has none): for a dead-lettered event, whose headers the dead letter
// keeps.
func EventIDOf(msgID, stream string, seq int64) string {
	if id := storableEventID(msgID); id != "" {
		return id
	}
	return "stream/" + stream + "/" + strconv.FormatInt(seq, 10)
}

// EventKey is an event's key, the bytes its lane is chosen by
// (outbox.LaneOf): the base64 key header's bytes, else the text key's.
func EventKey(h nats.Header) []byte {
	if k, err := base64.StdEncoding.DecodeString(h.Get(outbox.HeaderKeyBase64)); err == nil && len(k) > 0 {
		return k
	}
	if k := h.Get(outbox.HeaderKey); k != "" {
		return []byte(k)
	}
	return nil
}

// storableEventID keeps an event id that is valid text as it is. Any
// publisher may set Nats-Msg-Id, to any bytes; one holding NUL or invalid
// UTF-8 cannot key the event inbox (a text column), so it is replaced by
// "bin:" and the hex of its bytes: deterministic, so redeliveries still
// find the event's inbox row, and distinct for distinct ids.
func storableEventID(id string) string {
	if pgdata.ValidText(id) {
		return id
	}
	return "bin:" + hex.EncodeToString([]byte(id))
}
