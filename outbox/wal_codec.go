package outbox

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kfn-dev/kfn/internal/pgdata"
)

// WALPrefix is the prefix of the logical decoding messages that carry the
// events of the WAL outbox (pg_logical_emit_message's second argument). The
// relay reads the messages with this prefix and ignores every other.
const WALPrefix = "kfn.outbox"

// walVersion is the first byte of a WAL event's payload. A relay refuses a
// payload of a version it does not know (and holds the slot there) rather
// than skip an event a newer worker wrote.
const walVersion = 1

// Flags of a WAL event's second byte.
const (
	walFlagRawID     = 1 << 0 // the event id is a UUID, stored as its 16 bytes
	walFlagTypeIsSub = 1 << 1 // the type equals the subject and is not stored
)

// encodeWALEvent is the payload of row's logical decoding message: all the
// relay needs to publish the message the table outbox's row would give,
// byte for byte (same Nats-Msg-Id, subject, headers and data).
//
// Version 1, after the version byte and a flags byte, in this order:
//
//	event id      16 bytes (walFlagRawID) or a string
//	subject       string
//	type          string, absent with walFlagTypeIsSub
//	key           string (any bytes)
//	source        string (the emitting function)
//	source topic  string
//	partition     zig-zag varint
//	offset        zig-zag varint
//	created_at    zig-zag varint, microseconds since the Unix epoch
//	headers       uvarint count, then name and value strings, sorted by name
//	data          the rest of the payload
//
// A string is a uvarint length and its bytes. Every length is checked when
// decoding, so any bytes in keys, headers and data travel unchanged.
func encodeWALEvent(dst []byte, r Row, createdAt time.Time) []byte {
	headers := r.headers()
	flags := byte(0)
	id, rawID := uuidBytes(r.EventID)
	if rawID {
		flags |= walFlagRawID
	}
	if r.Event.Type == r.Event.Subject {
		flags |= walFlagTypeIsSub
	}
	dst = append(dst, walVersion, flags)
	if rawID {
		dst = append(dst, id[:]...)
	} else {
		dst = appendString(dst, r.EventID)
	}
	dst = appendString(dst, r.Event.Subject)
	if flags&walFlagTypeIsSub == 0 {
		dst = appendString(dst, r.Event.Type)
	}
	dst = appendString(dst, r.Event.Key)
	dst = appendString(dst, r.Origin.Consumer)
	dst = appendString(dst, pgdata.Text(r.Origin.Topic))
	dst = binary.AppendVarint(dst, int64(r.Origin.Partition))
	dst = binary.AppendVarint(dst, r.Origin.Offset)
	dst = binary.AppendVarint(dst, createdAt.UnixMicro())
	names := make([]string, 0, len(headers))
	for k := range headers {
		names = append(names, k)
	}
	slices.Sort(names)
	dst = binary.AppendUvarint(dst, uint64(len(names)))
	for _, k := range names {
		dst = appendString(dst, k)
		dst = appendString(dst, headers[k])
	}
	return append(dst, r.Event.Data...)
}

// errWALPayload is a payload decodeWALEvent cannot read.
var errWALPayload = errors.New("malformed WAL outbox event")

// decodeWALEvent reads a payload encodeWALEvent wrote. The row's strings
// and data are copies: the payload's buffer may be reused. Its strings
// share one copy of the payload's part before the data (the data is
// copied once more, as bytes): an event costs three allocations and a
// map for its headers, where a string each cost seven.
func decodeWALEvent(p []byte) (relayRow, error) {
	var row relayRow
	if len(p) < 2 {
		return row, fmt.Errorf("%w: %d bytes", errWALPayload, len(p))
	}
	if p[0] != walVersion {
		return row, fmt.Errorf("%w: version %d, this relay reads version %d: upgrade the relay", errWALPayload, p[0], walVersion)
	}
	flags := p[1]
	d := walDecoder{p: p[2:], off: 2}
	var id, subject, typ, key, source, topic walSpan
	if flags&walFlagRawID != 0 {
		row.EventID = formatUUID(d.bytes(16))
	} else {
		id = d.span()
	}
	subject = d.span()
	typ = subject
	if flags&walFlagTypeIsSub == 0 {
		typ = d.span()
	}
	key = d.span()
	source = d.span()
	topic = d.span()
	row.SourcePartition = int32(d.varint())
	row.SourceOffset = d.varint()
	row.CreatedAt = time.UnixMicro(d.varint()).UTC()
	var headers []walSpan // name, value, name, value…
	if n := d.uvarint(); n > 0 && d.err == nil {
		if n > uint64(len(d.p)) {
			return row, fmt.Errorf("%w: %d headers in %d bytes", errWALPayload, n, len(d.p))
		}
		headers = make([]walSpan, 0, 2*n)
		for range n {
			headers = append(headers, d.span(), d.span())
		}
	}
	if d.err != nil {
		return row, d.err
	}
	text := string(p[:d.off])
	if flags&walFlagRawID == 0 {
		row.EventID = id.in(text)
	}
	row.Subject, row.Type, row.Key = subject.in(text), typ.in(text), key.in(text)
	row.Source, row.SourceTopic = source.in(text), topic.in(text)
	if len(headers) > 0 {
		row.Headers = make(map[string]string, len(headers)/2)
		for i := 0; i < len(headers); i += 2 {
			row.Headers[headers[i].in(text)] = headers[i+1].in(text)
		}
	}
	row.Data = slices.Clone(d.p)
	if row.Data == nil {
		row.Data = []byte{}
	}
	return row, nil
}

// walSpan is where a string lies in a payload: bytes [from, to).
type walSpan struct{ from, to int }

// in is the span's string in text, a copy of the payload's start.
func (s walSpan) in(text string) string { return text[s.from:s.to] }

// walDecoder reads a payload from its front; off is how far into the
// payload p starts.
type walDecoder struct {
	p   []byte
	off int
	err error
}

func (d *walDecoder) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: truncated %s", errWALPayload, what)
	}
	d.p = nil
}

func (d *walDecoder) skip(n int) {
	d.p = d.p[n:]
	d.off += n
}

func (d *walDecoder) bytes(n int) []byte {
	if d.err != nil || n < 0 || n > len(d.p) {
		d.fail("field")
		return nil
	}
	b := d.p[:n]
	d.skip(n)
	return b
}

func (d *walDecoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.p)
	if n <= 0 {
		d.fail("length")
		return 0
	}
	d.skip(n)
	return v
}

func (d *walDecoder) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.p)
	if n <= 0 {
		d.fail("number")
		return 0
	}
	d.skip(n)
	return v
}

// span reads a string: its length, then its bytes, whose place it returns.
func (d *walDecoder) span() walSpan {
	n := d.uvarint()
	if n > uint64(len(d.p)) {
		d.fail("string")
		return walSpan{}
	}
	from := d.off
	d.skip(int(n))
	return walSpan{from, d.off}
}

func appendString(dst []byte, s string) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

// uuidBytes parses a UUID in EventID's form (lower-case hex, dashes at 8,
// 13, 18 and 23); ok is false for anything else, which travels as text.
func uuidBytes(s string) (id [16]byte, ok bool) {
	if len(s) != 36 || s[8] != '-' || s[13] != '-' || s[18] != '-' || s[23] != '-' {
		return id, false
	}
	hexText := s[0:8] + s[9:13] + s[14:18] + s[19:23] + s[24:36]
	for i := 0; i < len(hexText); i++ {
		if c := hexText[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return id, false
		}
	}
	if _, err := hex.Decode(id[:], []byte(hexText)); err != nil {
		return id, false
	}
	return id, true
}

func formatUUID(b []byte) string {
	if len(b) != 16 {
		return ""
	}
	var buf [36]byte
	hex.Encode(buf[0:8], b[0:4])
	buf[8] = '-'
	hex.Encode(buf[9:13], b[4:6])
	buf[13] = '-'
	hex.Encode(buf[14:18], b[6:8])
	buf[18] = '-'
	hex.Encode(buf[19:23], b[8:10])
	buf[23] = '-'
	hex.Encode(buf[24:], b[10:16])
	return string(buf[:])
}
