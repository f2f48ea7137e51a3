package outbox

import (
	"encoding/base64"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Message headers the relay sets. The ce- names are the CloudEvents NATS
// protocol binding's attribute headers (binary content mode); the data is
// the message body as emitted.
const (
	HeaderSpecVersion     = "ce-specversion"
	HeaderID              = "ce-id"
	HeaderType            = "ce-type"
	HeaderSource          = "ce-source"
	HeaderTime            = "ce-time"
	HeaderSubject         = "ce-subject"
	HeaderSourceTopic     = "kfn-source-topic"
	HeaderSourcePartition = "kfn-source-partition"
	HeaderSourceOffset    = "kfn-source-offset"
	// HeaderKey carries the event key when it is a valid header value
	// (ValidHeaderValue); ce-subject then carries it too. Any other key
	// (binary, say a Confluent-framed one starting with 0x00) travels
	// base64-encoded (standard alphabet, padded) in HeaderKeyBase64 instead,
	// and the message has neither kfn-key nor ce-subject. A consumer reads
	// kfn-key-b64 first.
	HeaderKey       = "kfn-key"
	HeaderKeyBase64 = "kfn-key-b64"
)

// CloudEventsSourcePrefix prefixes the emitting function's name in ce-source.
const CloudEventsSourcePrefix = "kfn/"

// relayHeaders are the headers an event's own headers cannot override.
var relayHeaders = map[string]bool{
	HeaderSpecVersion: true, HeaderID: true, HeaderType: true, HeaderSource: true,
	HeaderTime: true, HeaderSubject: true, HeaderSourceTopic: true,
	HeaderSourcePartition: true, HeaderSourceOffset: true, HeaderKey: true, HeaderKeyBase64: true,
	jetstream.MsgIDHeader: true, jetstream.ExpectedStreamHeader: true,
}

// buildMessage turns a row into the message to publish: the row's stored
// headers (W3C traceparent among them when the source had one), then the
// CloudEvents and kfn headers, Nats-Msg-Id = event id for JetStream's
// duplicate window, and Nats-Expected-Stream so the event lands in the
// relay's stream or fails. source is the ce-source value,
// CloudEventsSourcePrefix + row.Source (callers cache it). It returns the
// names of stored headers it had to drop: those NATS headers cannot carry,
// and those starting with "Nats-", which steer JetStream (rollups, TTLs,
// expectations) and are the relay's alone. With buf, the message, its
// header map and its values are buf's, refilled (see messageBuf); with
// nil, they are new.
func buildMessage(row *relayRow, stream, source string, buf *messageBuf) (*nats.Msg, []string) {
	if buf == nil {
		buf = &messageBuf{}
	}
	// Every header has one value; they share one backing array.
	values := slices.Grow(buf.values[:0], len(row.Headers)+relayHeaderCount)
	h := buf.msg.Header
	if h == nil {
		h = make(nats.Header, len(row.Headers)+relayHeaderCount)
	}
	// A message with the relay's headers only, and the same ones as the
	// message before (its key travels the same way), has its values
	// written over the last ones in place: the map's value slices point
	// into values, whose backing array stays, so the map is left as it is
	// (clearing and filling it was a third of this function's CPU). Not
	// if the map holds more than the last message was built with: a
	// publish span writes its trace context into it.
	keyHeaders := keyHeadersOf(row.Key)
	inPlace := len(row.Headers) == 0 && buf.relayOnly > 0 && len(h) == buf.relayOnly && buf.keyHeaders == keyHeaders
	if !inPlace {
		clear(h)
	}
	set := func(k, v string) {
		values = append(values, v)
		if !inPlace {
			h[k] = values[len(values)-1 : len(values) : len(values)]
		}
	}
	var dropped []string
	for k, v := range row.Headers {
		if relayHeaders[k] {
			continue
		}
		if !validHeader(k, v) || hasPrefixFold(k, "Nats-") {
			dropped = append(dropped, k)
			continue
		}
		set(k, v)
	}
	set(HeaderSpecVersion, "1.0")
	set(HeaderID, row.EventID)
	set(HeaderType, row.Type)
	set(HeaderSource, source)
	set(HeaderTime, buf.timeText(row.CreatedAt))
	switch keyHeaders {
	case keyAsText:
		set(HeaderSubject, row.Key)
		set(HeaderKey, row.Key)
	case keyAsBase64:
		set(HeaderKeyBase64, base64.StdEncoding.EncodeToString([]byte(row.Key)))
	}
	set(HeaderSourceTopic, row.SourceTopic)
	set(HeaderSourcePartition, strconv.Itoa(int(row.SourcePartition)))
	set(HeaderSourceOffset, strconv.FormatInt(row.SourceOffset, 10))
	set(jetstream.MsgIDHeader, row.EventID)
	set(jetstream.ExpectedStreamHeader, stream)
	buf.values = values
	buf.msg = nats.Msg{Subject: row.Subject, Header: h, Data: row.Data}
	buf.relayOnly, buf.keyHeaders = 0, keyHeaders
	if len(row.Headers) == 0 {
		buf.relayOnly = len(h)
	}
	return &buf.msg, dropped
}

// keyHeaders is how an event's key travels in its message's headers.
type keyHeaders uint8

const (
	keyAbsent   keyHeaders = iota // an empty key: no key header
	keyAsText                     // ce-subject and kfn-key
	keyAsBase64                   // kfn-key-b64
)

func keyHeadersOf(key string) keyHeaders {
	switch {
	case key == "":
		return keyAbsent
	case ValidHeaderValue(key):
		return keyAsText
	}
	return keyAsBase64
}

// messageBuf is what buildMessage reuses from one message to the next. A
// core NATS publish encodes the message before it returns, and the relay
// retries a failed publish itself with a message built anew, so nothing
// keeps a message once it is sent.
type messageBuf struct {
	msg    nats.Msg
	values []string
	// relayOnly is how many headers msg was built with when they were
	// the relay's only (0 otherwise), and keyHeaders says which key
	// headers were among them.
	relayOnly  int
	keyHeaders keyHeaders
	// lastTime is the last ce-time formatted, lastTimeText its text: the
	// rows of one transaction share their created_at, so most rows reuse it.
	lastTime     time.Time
	lastTimeText string
}

// timeText is t as ce-time: RFC 3339 in UTC, to the nanosecond.
func (b *messageBuf) timeText(t time.Time) string {
	if b.lastTimeText == "" || !t.Equal(b.lastTime) {
		b.lastTime, b.lastTimeText = t, t.UTC().Format(time.RFC3339Nano)
	}
	return b.lastTimeText
}

// relayHeaderCount is the most headers buildMessage sets itself.
const relayHeaderCount = 12

// ValidHeaderValue reports whether s travels unchanged as a NATS header
// value that any consumer can read as text: valid UTF-8 without control
// characters (a tab is fine) and without leading or trailing spaces, which
// header parsers trim.
func ValidHeaderValue(s string) bool {
	if !utf8.ValidString(s) || strings.TrimSpace(s) != s {
		return false
	}
	for _, c := range s {
		if c < ' ' && c != '\t' || c == 0x7f {
			return false
		}
	}
	return true
}

// validHeader reports whether a name and value can travel as a NATS header:
// printable name without ':' or spaces, value without line breaks.
func validHeader(name, value string) bool {
	if name == "" || strings.ContainsAny(value, "\r\n") {
		return false
	}
	for _, c := range name {
		if c <= ' ' || c == ':' || c >= 0x7f {
			return false
		}
	}
	return true
}

func hasPrefixFold(s, prefix string) bool {
	return len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix)
}
