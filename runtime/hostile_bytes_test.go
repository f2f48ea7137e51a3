package runtime_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/internal/pgdata"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/runtime"
)

// envHostileSeed replays a run of TestHostileBytesNeverStallAPartition.
const envHostileSeed = "KFN_TEST_HOSTILE_SEED"

// TestHostileBytesNeverStallAPartition produces records with random hostile
// bytes everywhere (keys, values, header names and values: NUL, invalid
// UTF-8, Confluent-framed keys, 1,000+ headers, huge header values, empty
// and null values), half with kcat and half with kafka-go, interleaved with
// valid records on the same partitions. The function applies records whose
// value is a JSON object (and emits an event for them, keyed by the record's
// key, carrying its trace context) and fails the rest permanently with an
// error that quotes the value's raw bytes.
//
// Every partition must reach its high watermark in bounded time, every
// valid record must be applied exactly once with its outbox row, every
// other record must be dead-lettered with a reason and its exact bytes, and
// no batch may be retried as an infrastructure error.
func TestHostileBytesNeverStallAPartition(t *testing.T) {
	kcat, err := exec.LookPath("kcat")
	if err != nil {
		t.Fatal("kcat is not installed (Debian: apt-get install kcat); .ci/run installs it")
	}
	seed := rand.Uint64()
	if s := os.Getenv(envHostileSeed); s != "" {
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("%s=%q: %v", envHostileSeed, s, err)
		}
	}
	t.Logf("seed %d (replay with %s=%d)", seed, envHostileSeed, seed)
	g := &hostileGen{rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}

	const partitions = 3
	b := setup(t, partitions)
	b.cfg.NoRelay = true // keep the outbox rows to check them
	limit := settings.DefaultMaxRecordBytes
	b.cfg.MaxRecordBytes = limit
	chunks := g.plan(partitions, 60)

	w, stop := b.run(t, hostileFunction(b.fn, b.topic))
	defer stop()
	start := time.Now()
	p := &hostileProducer{t: t, b: b, kcat: kcat, dir: t.TempDir()}
	var plan []*plannedRecord
	for _, c := range chunks {
		p.produce(c)
		plan = append(plan, c.recs...)
	}
	produced := time.Since(start)

	// Bounded time to the high watermark on every partition.
	hw := b.kafka.HighWatermarks(t, b.topic)
	const bound = 90 * time.Second
	caughtUp := func() bool {
		for part, end := range hw {
			var next int64
			err := b.pg.Pool.QueryRow(context.Background(),
				`SELECT coalesce((SELECT next_offset FROM kfn.cursors WHERE consumer = $1 AND topic = $2 AND partition = $3), -1)`,
				b.fn, b.topic, part).Scan(&next)
			if err != nil || next < end {
				return false
			}
		}
		return true
	}
	for !caughtUp() {
		if time.Since(start) > bound {
			t.Fatalf("seed %d: the cursors did not reach the high watermarks %v within %s: a partition stalled (stats: retries %d, infrastructure retries %d)",
				seed, hw, bound, w.Stats().Retries.Load(), w.Stats().InfraRetries.Load())
		}
		time.Sleep(20 * time.Millisecond)
	}
	elapsed := time.Since(start)
	stop()

	// What the broker holds is what the worker read: pair it with the plan.
	got := readAll(t, b, hw)
	byPart := map[int32][]*plannedRecord{}
	for _, r := range plan {
		byPart[r.partition] = append(byPart[r.partition], r)
	}
	valid, hostile, oversized, viaKcat, traceDropped := 0, 0, 0, 0, 0
	for part, recs := range byPart {
		msgs := got[part]
		if len(msgs) != len(recs) {
			t.Fatalf("seed %d: partition %d holds %d records, %d were produced", seed, part, len(msgs), len(recs))
		}
		for i, r := range recs {
			m := msgs[i]
			r.offset, r.stored = m.Offset, m
			if !sameRecord(r, m) {
				t.Fatalf("seed %d: partition %d offset %d: the broker holds key %q value %.80q %d headers, produced (%s) key %q value %.80q %d headers",
					seed, part, m.Offset, m.Key, m.Value, len(m.Headers), r.producer(), r.key, r.value, len(r.headers))
			}
			switch {
			case recordBytes(m) > limit:
				oversized++
			case isJSONObject(m.Value):
				valid++
				if r.traceDropped {
					traceDropped++
				}
			default:
				hostile++
			}
			if r.viaKcat {
				viaKcat++
			}
		}
	}
	t.Logf("seed %d: %d records (%d valid JSON objects, many with hostile keys and headers; %d hostile values; %d oversized; %d produced with kcat, %d with kafka-go) on %d partitions; "+
		"produced in %s while the worker ran; every partition at its high watermark %s after the first record was produced (%s after the last)",
		seed, len(plan), valid, hostile, oversized, viaKcat, len(plan)-viaKcat, partitions, produced.Round(time.Millisecond), elapsed.Round(time.Millisecond), (elapsed - produced).Round(time.Millisecond))

	ctx := context.Background()
	effectsByOffset := map[[2]int64]int{}
	rows, err := b.pg.Pool.Query(ctx, `SELECT partition, "offset" FROM `+effects.Table(b.fn))
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var part, off int64
		if err := rows.Scan(&part, &off); err != nil {
			t.Fatal(err)
		}
		effectsByOffset[[2]int64{part, off}]++
	}
	dead, err := inbox.ListDeadLetters(ctx, b.pg.Pool, b.fn, 100000)
	if err != nil {
		t.Fatal(err)
	}
	deadByOffset := map[[2]int64]inbox.DeadLetter{}
	for _, d := range dead {
		deadByOffset[[2]int64{int64(d.Partition.Partition), d.Offset}] = d
	}
	type outboxRow struct {
		Key     []byte
		Headers map[string]string
	}
	outboxByOffset := map[[2]int64][]outboxRow{}
	rows, err = b.pg.Pool.Query(ctx, `SELECT source_partition, source_offset, event_key, headers FROM kfn.outbox`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var part, off int64
		var r outboxRow
		if err := rows.Scan(&part, &off, &r.Key, &r.Headers); err != nil {
			t.Fatal(err)
		}
		outboxByOffset[[2]int64{part, off}] = append(outboxByOffset[[2]int64{part, off}], r)
	}

	failures := 0
	fail := func(r *plannedRecord, format string, args ...any) {
		t.Helper()
		failures++
		if failures <= 15 {
			t.Errorf("seed %d: %s/%d@%d (%s): %s", seed, b.topic, r.partition, r.offset, r.producer(), fmt.Sprintf(format, args...))
		}
	}
	for _, r := range plan {
		at := [2]int64{int64(r.partition), r.offset}
		m := r.stored
		d, isDead := deadByOffset[at]
		ob := outboxByOffset[at]
		if recordBytes(m) <= limit && isJSONObject(m.Value) {
			if n := effectsByOffset[at]; n != 1 || isDead {
				fail(r, "valid record applied %d times, dead-lettered %v; want applied once", n, isDead)
			}
			if len(ob) != 1 {
				fail(r, "valid record has %d outbox rows, want 1", len(ob))
				continue
			}
			if !bytes.Equal(ob[0].Key, m.Key) {
				fail(r, "outbox event key %q, want the record key %q", ob[0].Key, m.Key)
			}
			if got := ob[0].Headers["traceparent"]; got != r.wantTraceParent {
				fail(r, "outbox traceparent %q, want %q", got, r.wantTraceParent)
			}
			if got := ob[0].Headers["tracestate"]; got != r.wantTraceState {
				fail(r, "outbox tracestate %q, want %q", got, r.wantTraceState)
			}
			continue
		}
		if n := effectsByOffset[at]; n != 0 || len(ob) != 0 {
			fail(r, "bad record has %d effects and %d outbox rows, want none", n, len(ob))
		}
		if !isDead {
			fail(r, "bad record was neither applied nor dead-lettered")
			continue
		}
		if d.StoredRaw {
			fail(r, "dead letter stored as a raw blob: Postgres should take these bytes column by column")
		}
		if !pgdata.ValidText(d.Error) || d.Error == "" {
			fail(r, "dead letter error %q is empty or not valid text", d.Error)
		}
		if !bytes.Equal(d.Key, m.Key) || (d.Key == nil) != (m.Key == nil) {
			fail(r, "dead letter key %q, produced %q", d.Key, m.Key)
		}
		if recordBytes(m) > limit {
			sum := sha256.Sum256(m.Value)
			prefix := m.Value[:min(len(m.Value), 4096)]
			if d.Reason != "oversized" || !bytes.Equal(d.Value, prefix) || d.ValueSize != int64(len(m.Value)) ||
				(len(m.Value) > 4096) != (d.ValueSHA256 != nil) || (d.ValueSHA256 != nil && !bytes.Equal(d.ValueSHA256, sum[:])) {
				fail(r, "oversized dead letter: reason %q, %d value bytes, size %d, sha256 %x; want oversized, the first %d of %d bytes and their hash %x",
					d.Reason, len(d.Value), d.ValueSize, d.ValueSHA256, len(prefix), len(m.Value), sum)
			}
			if headerBytes(m)+len(m.Key) > limit {
				if d.Headers != nil {
					fail(r, "oversized dead letter kept %d headers although they alone are over the limit", len(d.Headers))
				}
				continue
			}
		} else {
			if d.Reason != "permanent" || !strings.Contains(d.Error, "not a JSON object") {
				fail(r, "dead letter reason %q error %.100q; want permanent, not a JSON object", d.Reason, d.Error)
			}
			if !bytes.Equal(d.Value, m.Value) || (d.Value == nil) != (m.Value == nil) {
				fail(r, "dead letter value %.80q, produced %.80q", d.Value, m.Value)
			}
		}
		if len(d.Headers) != len(m.Headers) {
			fail(r, "dead letter has %d headers, produced %d", len(d.Headers), len(m.Headers))
			continue
		}
		for i, h := range m.Headers {
			dh := d.Headers[i]
			if string(dh.Key) != h.Key || !bytes.Equal(dh.Value, h.Value) || (dh.Value == nil) != (h.Value == nil) {
				fail(r, "dead letter header %d = %.60q=%.60q (null %v), produced %.60q=%.60q (null %v)", i, dh.Key, dh.Value, dh.Value == nil, h.Key, h.Value, h.Value == nil)
				break
			}
		}
	}
	if failures > 15 {
		t.Errorf("seed %d: … %d failures in all", seed, failures)
	}
	if len(dead) != hostile+oversized {
		t.Errorf("seed %d: %d dead letters, want %d", seed, len(dead), hostile+oversized)
	}

	st := w.Stats()
	if n := st.InfraRetries.Load(); n != 0 {
		t.Errorf("seed %d: %d batches retried as infrastructure errors, want 0", seed, n)
	}
	if n := st.Retries.Load(); n != 0 {
		t.Errorf("seed %d: %d handler retries, want 0 (every bad record is permanent; none may hit a data error)", seed, n)
	}
	if n := st.TraceContextDropped.Load(); n != int64(traceDropped) {
		t.Errorf("seed %d: trace context dropped for %d records, want %d", seed, n, traceDropped)
	}
	var every, deadLettered []effects.Produced
	for _, r := range plan {
		p := effects.Produced{Partition: r.partition, Offset: r.offset}
		every = append(every, p)
		if recordBytes(r.stored) > limit || !isJSONObject(r.stored.Value) {
			deadLettered = append(deadLettered, p)
		}
	}
	rep, err := effects.Check(ctx, b.pg.Pool, b.fn, b.topic, every)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK(deadLettered...) || rep.Applied != valid {
		t.Errorf("seed %d: checker: %s %v; want %d applied once each, in order, and the rest dead-lettered", seed, rep, rep.Violations(deadLettered...), valid)
	}
	if t.Failed() {
		t.Logf("replay with %s=%d", envHostileSeed, seed)
	}
}

// hostileFunction applies records whose value is a JSON object, recording an
// effect (the effects checker's table) and emitting an event keyed by the
// record's key; it fails every other record permanently, quoting the raw
// bytes of its value in the error.
func hostileFunction(name, topic string) runtime.Function {
	fn := effects.Function(name, topic)
	apply := fn.Handler
	fn.Handler = func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
		if !isJSONObject(rec.Value) {
			return runtime.Permanent(fmt.Errorf("not a JSON object: %s", rec.Value[:min(len(rec.Value), 64)]))
		}
		return apply(ctx, tx, rec, out)
	}
	return fn
}

func isJSONObject(v []byte) bool {
	var doc map[string]any
	return v != nil && json.Unmarshal(v, &doc) == nil && doc != nil
}

func headerBytes(m kafka.Message) int {
	n := 0
	for _, h := range m.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return n
}

func recordBytes(m kafka.Message) int { return len(m.Key) + len(m.Value) + headerBytes(m) }

// plannedRecord is one record the test produces, and what it expects of it.
type plannedRecord struct {
	partition int32
	viaKcat   bool
	kcatStdin bool // kcat reads it from stdin (-K/-D delimiters) rather than a file
	key       []byte
	value     []byte
	headers   []kafka.Header
	// wantTraceParent and wantTraceState are what the outbox row of a valid
	// record must carry; traceDropped says the record's trace context is
	// invalid in part or whole.
	wantTraceParent, wantTraceState string
	traceDropped                    bool

	offset int64
	stored kafka.Message
}

func (r *plannedRecord) producer() string {
	if r.viaKcat {
		return "kcat"
	}
	return "kafka-go"
}

// sameRecord compares the bytes that were produced with those the broker
// holds, not whether they are null: kafka-go's writer sends a null header
// value as an empty one, and kcat sends an empty key as null.
func sameRecord(r *plannedRecord, m kafka.Message) bool {
	if !bytes.Equal(r.key, m.Key) || !bytes.Equal(r.value, m.Value) || len(r.headers) != len(m.Headers) {
		return false
	}
	for i, h := range r.headers {
		if h.Key != m.Headers[i].Key || !bytes.Equal(h.Value, m.Headers[i].Value) {
			return false
		}
	}
	return true
}

// chunk is one produce call: several records with kafka-go or kcat's
// stdin, or a single record through a kcat file.
type chunk struct{ recs []*plannedRecord }

type hostileGen struct {
	rng *rand.Rand
	n   int
}

// pieces hostile byte strings are made of.
var hostilePieces = []string{
	"\x00", "\x00\x00", "\xff", "\xfe", "\xc3", "\xc3(", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82",
	"\x01", "\x1b[31m", "\x7f", "\r\n", "\n", "\t", "\\", "\\x00", "\\u0000", `"`, "'", "=", ",", ":", ";", " ",
	"é", "✓", "\U0001F600", "\u2028", "\ufeff", "a", "Z", "0", "{", "}", "[", "%s", "%!",
}

func (g *hostileGen) bytes(n int, allowed func(byte) bool) []byte {
	out := make([]byte, 0, n+8)
	for len(out) < n {
		var piece string
		if g.rng.IntN(4) == 0 {
			piece = string([]byte{byte(g.rng.UintN(256))})
		} else {
			piece = hostilePieces[g.rng.IntN(len(hostilePieces))]
		}
		out = append(out, piece...)
	}
	out = out[:n]
	if allowed != nil {
		for i, c := range out {
			if !allowed(c) {
				out[i] = 'x'
			}
		}
	}
	return out
}

// Byte rules of kcat's command line (no NUL in argv; '=' ends a header
// name) and of its stdin framing (the -K and -D delimiters).
const kcatKeyDelim, kcatMsgDelim = 0x1f, 0x1e

func argvByte(c byte) bool       { return c != 0 }
func headerNameByte(c byte) bool { return c != 0 && c != '=' }
func stdinByte(c byte) bool      { return c != kcatKeyDelim && c != kcatMsgDelim }

func (g *hostileGen) key(viaKcat, stdin bool) []byte {
	var allowed func(byte) bool
	if viaKcat {
		allowed = argvByte
		if stdin {
			allowed = stdinByte
		}
	}
	var k []byte
	switch g.rng.IntN(6) {
	case 0:
		return nil
	case 1:
		k = []byte(fmt.Sprintf("key-%d", g.rng.IntN(20)))
	case 2: // Confluent wire format: magic byte 0, a 4-byte schema id, the payload
		k = binary.BigEndian.AppendUint32([]byte{0}, g.rng.Uint32N(1000))
		k = append(k, g.bytes(g.rng.IntN(20), nil)...)
	case 3:
		k = g.bytes(1+g.rng.IntN(40), nil)
	case 4:
		k = g.bytes(1000+g.rng.IntN(2000), nil)
	default:
		k = g.bytes(1+g.rng.IntN(8), nil)
	}
	for i, c := range k {
		if allowed != nil && !allowed(c) {
			k[i] = 'x'
		}
	}
	if viaKcat && !stdin && !argvByte(k[0]) {
		k[0] = 'x'
	}
	return k
}

// value returns a JSON object (valid) or something else (hostile).
func (g *hostileGen) value(valid, viaKcat bool, allowed func(byte) bool) []byte {
	g.n++
	if valid {
		doc := map[string]any{"n": g.n, "s": string(g.bytes(g.rng.IntN(30), nil))} // Marshal turns invalid UTF-8 into U+FFFD
		if g.rng.IntN(3) == 0 {
			doc["nul"] = "a\x00b" // valid JSON (\u0000), and a value Postgres text would refuse
		}
		v, _ := json.Marshal(doc)
		for _, c := range v {
			if allowed != nil && !allowed(c) {
				panic("JSON with a forbidden byte")
			}
		}
		return v
	}
	for {
		var v []byte
		switch g.rng.IntN(9) {
		case 0:
			if !viaKcat {
				return nil // a tombstone
			}
			v = []byte("\x00")
		case 1:
			if !viaKcat {
				return []byte{} // empty, which is not a tombstone
			}
			v = []byte("\xff")
		case 2:
			v = []byte(`[1,2]`)
		case 3:
			v = []byte(`null`)
		case 4:
			v = append([]byte(`{"a":`), g.bytes(1+g.rng.IntN(20), nil)...)
		case 5: // Confluent framing in front of JSON
			v = append(binary.BigEndian.AppendUint32([]byte{0}, 7), fmt.Sprintf(`{"n":%d}`, g.n)...)
		case 6:
			v = []byte("{\"a\":\"\x00\"}") // a raw NUL in a JSON string is invalid JSON
		default:
			v = g.bytes(1+g.rng.IntN(200), nil)
		}
		for i, c := range v {
			if allowed != nil && !allowed(c) {
				v[i] = 'x'
			}
		}
		if !isJSONObject(v) {
			return v
		}
	}
}

func validTraceParent(g *hostileGen) string {
	var b [24]byte
	for i := range b {
		b[i] = byte(g.rng.UintN(256))
	}
	b[0] |= 1 // never an all-zero id
	b[16] |= 1
	return fmt.Sprintf("00-%x-%x-01", b[:16], b[16:])
}

// headers returns the record's headers and sets its expected trace context.
func (g *hostileGen) headers(r *plannedRecord) {
	nameOK, valueOK := func(byte) bool { return true }, func(byte) bool { return true }
	if r.viaKcat {
		nameOK, valueOK = headerNameByte, argvByte
	}
	count := 0
	switch x := g.rng.IntN(10); {
	case x < 4:
	case x < 9:
		count = 1 + g.rng.IntN(5)
	}
	for range count {
		name := g.bytes(g.rng.IntN(16), nameOK)
		if r.viaKcat && len(name) == 0 {
			name = []byte("h")
		}
		var value []byte
		switch g.rng.IntN(6) {
		case 0:
			value = nil // a null header value (kcat: -H name)
		case 1:
			value = []byte{}
		default:
			value = g.bytes(g.rng.IntN(60), valueOK)
		}
		if r.viaKcat && value != nil && len(value) == 0 {
			value = nil // kcat cannot send an empty header value apart from null
		}
		r.headers = append(r.headers, kafka.Header{Key: string(name), Value: value})
	}
	// The trace context, at a random place among the other headers.
	var trace []kafka.Header
	switch g.rng.IntN(7) {
	case 0, 1: // none
	case 2: // valid, with a valid tracestate
		tp := validTraceParent(g)
		trace = []kafka.Header{{Key: "traceparent", Value: []byte(tp)}, {Key: "tracestate", Value: []byte("kfn=t" + strconv.Itoa(g.rng.IntN(99)) + ",rojo=00f067aa0ba902b7")}}
		r.wantTraceParent, r.wantTraceState = tp, string(trace[1].Value)
	case 3: // valid alone
		tp := validTraceParent(g)
		trace = []kafka.Header{{Key: "traceparent", Value: []byte(tp)}}
		r.wantTraceParent = tp
	case 4: // valid traceparent, invalid tracestate: the parent goes on alone
		tp := validTraceParent(g)
		bad := "rojo=\xff"
		if !r.viaKcat && g.rng.IntN(2) == 0 {
			bad = "rojo=a\x00b"
		}
		trace = []kafka.Header{{Key: "traceparent", Value: []byte(tp)}, {Key: "tracestate", Value: []byte(bad)}}
		r.wantTraceParent, r.traceDropped = tp, true
	default: // an invalid traceparent: hostile bytes in a well-formed frame, or none at all
		tp := []byte(validTraceParent(g))
		switch g.rng.IntN(4) {
		case 0:
			if !r.viaKcat {
				tp[10] = 0
				break
			}
			fallthrough
		case 1:
			tp[10] = 0xff
		case 2:
			tp = bytes.ToUpper(tp)
		default:
			tp = g.bytes(1+g.rng.IntN(60), valueOK)
		}
		trace = []kafka.Header{{Key: "traceparent", Value: tp}}
		r.traceDropped = true
	}
	at := g.rng.IntN(len(r.headers) + 1)
	r.headers = append(r.headers[:at], append(trace, r.headers[at:]...)...)
}

// plan makes rounds of chunks over the partitions, then the extreme records:
// 1,000+ headers and huge header values, from both producers.
func (g *hostileGen) plan(partitions, rounds int) []chunk {
	var out []chunk
	for range rounds {
		for p := range partitions {
			c := chunk{}
			viaKcat := g.rng.IntN(2) == 0
			stdin := viaKcat && g.rng.IntN(2) == 0
			n := 1 + g.rng.IntN(4)
			if viaKcat && !stdin {
				n = 1
			}
			withHeaders := !stdin || g.rng.IntN(2) == 0 // a kcat stdin chunk shares one header set
			var shared []kafka.Header
			var sharedTP, sharedTS string
			var sharedDropped bool
			for i := range n {
				r := &plannedRecord{partition: int32(p), viaKcat: viaKcat, kcatStdin: stdin}
				r.key = g.key(viaKcat, stdin)
				var allowed func(byte) bool
				if stdin {
					allowed = stdinByte
				}
				r.value = g.value(g.rng.IntN(2) == 0, viaKcat, allowed)
				switch {
				case !withHeaders:
				case stdin && i > 0:
					r.headers, r.wantTraceParent, r.wantTraceState, r.traceDropped = shared, sharedTP, sharedTS, sharedDropped
				default:
					g.headers(r)
					shared, sharedTP, sharedTS, sharedDropped = r.headers, r.wantTraceParent, r.wantTraceState, r.traceDropped
				}
				if stdin && r.key == nil {
					r.key = []byte("k") // an empty stdin key is sent as null; keep it simple
				}
				c.recs = append(c.recs, r)
			}
			out = append(out, c)
		}
	}
	// Extremes, one chunk each, spread over the partitions.
	for i := 0; i < 8; i++ {
		r := &plannedRecord{partition: int32(i % partitions), viaKcat: i%2 == 1}
		r.key = g.key(r.viaKcat, false)
		valid := g.rng.IntN(2) == 0
		nameOK, valueOK := func(byte) bool { return true }, func(byte) bool { return true }
		if r.viaKcat {
			nameOK, valueOK = headerNameByte, argvByte
		}
		switch i / 2 {
		case 0: // 1,000+ headers with odd names
			for j := 0; j < 1000+g.rng.IntN(300); j++ {
				name := append(g.bytes(1+g.rng.IntN(12), nameOK), fmt.Sprint(j)...)
				r.headers = append(r.headers, kafka.Header{Key: string(name), Value: g.bytes(g.rng.IntN(12), valueOK)})
			}
			r.value = g.value(valid, r.viaKcat, nil)
		case 1: // huge header values under the limit
			r.headers = g.bigHeaders(r.viaKcat, "big", 300<<10, valueOK)
			r.value = g.value(valid, r.viaKcat, nil)
		case 2: // oversized through huge headers plus a big value: the headers are kept
			r.headers = g.bigHeaders(r.viaKcat, "big\xff", 280<<10, valueOK)
			r.value = g.bytes(300<<10, nil)
			if valid {
				r.value, _ = json.Marshal(map[string]string{"pad": strings.Repeat("p", 300<<10)})
			}
		case 3: // oversized through headers alone: they are not kept
			r.headers = append(g.bigHeaders(r.viaKcat, "huge", 600<<10, valueOK), kafka.Header{Key: "small", Value: []byte("s")})
			r.value = g.value(valid, r.viaKcat, nil)
		}
		if r.viaKcat && len(r.value) == 0 {
			r.value = []byte("\x00")
		}
		out = append(out, chunk{recs: []*plannedRecord{r}})
	}
	// Shuffle the extremes in among the rest, keeping them whole chunks.
	g.rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}

// bigHeaders returns size bytes of header values named name: one header
// for kafka-go, several for kcat, whose command line takes at most 128 KiB
// per argument (Linux's MAX_ARG_STRLEN).
func (g *hostileGen) bigHeaders(viaKcat bool, name string, size int, allowed func(byte) bool) []kafka.Header {
	piece := size
	if viaKcat {
		piece = 100 << 10
	}
	var out []kafka.Header
	for i := 0; size > 0; i++ {
		n := min(piece, size)
		out = append(out, kafka.Header{Key: name + strconv.Itoa(i), Value: g.bytes(n, allowed)})
		size -= n
	}
	return out
}

// hostileProducer writes chunks with kafka-go or kcat.
type hostileProducer struct {
	t    *testing.T
	b    *bundle
	kcat string
	dir  string
	n    int
}

func (p *hostileProducer) produce(c chunk) {
	p.t.Helper()
	first := c.recs[0]
	if !first.viaKcat {
		msgs := make([]kafka.Message, len(c.recs))
		for i, r := range c.recs {
			msgs[i] = kafka.Message{Partition: int(r.partition), Key: r.key, Value: r.value, Headers: r.headers}
		}
		p.b.kafka.Produce(p.t, p.b.topic, msgs...)
		return
	}
	args := []string{"-b", strings.Join(p.b.kafka.Brokers, ","), "-P", "-t", p.b.topic, "-p", strconv.Itoa(int(first.partition)),
		"-X", "message.max.bytes=2000000"}
	for _, h := range first.headers {
		if h.Value == nil {
			args = append(args, "-H", h.Key)
		} else {
			args = append(args, "-H", h.Key+"="+string(h.Value))
		}
	}
	var stdin []byte
	if first.kcatStdin {
		args = append(args, "-K", fmt.Sprintf(`\x%02x`, kcatKeyDelim), "-D", fmt.Sprintf(`\x%02x`, kcatMsgDelim))
		for _, r := range c.recs {
			stdin = append(append(append(stdin, r.key...), kcatKeyDelim), r.value...)
			stdin = append(stdin, kcatMsgDelim)
		}
	} else {
		if first.key != nil {
			args = append(args, "-k", string(first.key))
		}
		p.n++
		file := filepath.Join(p.dir, fmt.Sprintf("value-%d", p.n))
		if err := os.WriteFile(file, first.value, 0o600); err != nil {
			p.t.Fatal(err)
		}
		args = append(args, file)
	}
	cmd := exec.Command(p.kcat, args...)
	cmd.Stdin = bytes.NewReader(stdin)
	if out, err := cmd.CombinedOutput(); err != nil {
		p.t.Fatalf("kcat (%d headers, %d records): %v\n%s", len(first.headers), len(c.recs), err, out)
	}
}

// readAll reads every record of the topic up to the high watermarks with
// franz-go, a client independent of the worker's reader that keeps a null
// key, value or header value apart from an empty one, as the broker does.
func readAll(t *testing.T, b *bundle, hw map[int]int64) map[int32][]kafka.Message {
	t.Helper()
	parts := map[int32]kgo.Offset{}
	for part := range hw {
		parts[int32(part)] = kgo.NewOffset().AtStart()
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.kafka.Brokers...), kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{b.topic: parts}))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out := map[int32][]kafka.Message{}
	complete := func() bool {
		for part, end := range hw {
			if int64(len(out[int32(part)])) < end {
				return false
			}
		}
		return true
	}
	for !complete() {
		fetches := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read back: %v; got %d records of partitions %v", ctx.Err(), len(out), hw)
		}
		if errs := fetches.Errors(); len(errs) > 0 {
			t.Fatalf("read back: %v", errs[0].Err)
		}
		fetches.EachRecord(func(r *kgo.Record) {
			m := kafka.Message{Topic: r.Topic, Partition: int(r.Partition), Offset: r.Offset, Key: r.Key, Value: r.Value}
			for _, h := range r.Headers {
				m.Headers = append(m.Headers, kafka.Header{Key: h.Key, Value: h.Value})
			}
			out[r.Partition] = append(out[r.Partition], m)
		})
	}
	return out
}
