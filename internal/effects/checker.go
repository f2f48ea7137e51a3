package effects

import (
	"bytes"
	"cmp"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/outbox"
)

// Produced is one record the test produced: where it landed.
type Produced struct {
	Partition int32
	Offset    int64
}

func (p Produced) String() string { return fmt.Sprintf("%d@%d", p.Partition, p.Offset) }

// Report is what the checker found. Every violation count must be zero,
// and the dead-lettered records must be exactly those the test expects:
// see OK.
//
// The checker reads what no dedup layer can hide: the effect rows (the
// test function's table has no unique key, so a second apply is a second
// row), the dead letters, the claim history in kfn.audit_log (which
// retention does not delete), and the emitted events in the outbox and the
// stream. It does not read kfn.inbox.
type Report struct {
	Expected int // records that were produced
	Applied  int // effect rows found
	// Lost counts produced records with neither an effect nor a dead letter.
	Lost int
	// Duplicated counts extra effect rows of one record, and effect rows of
	// a record that was also dead-lettered.
	Duplicated int
	// Reordered counts records whose effect committed (in commit order, see
	// insertSQL) after the effect of a higher offset of the same partition.
	Reordered int
	// Unexpected counts effect rows of records never produced.
	Unexpected int
	// DeadLetters counts dead-lettered records; DeadLettered lists them.
	DeadLetters  int
	DeadLettered []Produced
	// Retried counts records applied by a dead letter retry (kfn dlq
	// retry, audited as dlq_retry_applied). A retry applies a record after
	// the records that followed it, on purpose, so the order checks
	// (Reordered, ReorderedEvents) leave these records out; every other
	// check applies to them.
	Retried int
	// StaleEpochs counts stale-token commits: effects committed, in the
	// partition's commit order, after a claim of the partition with a
	// larger epoch (invariant I4). It counts them whether or not the
	// record also has a correct effect, so a zombie's commit that the
	// inbox (or the high-water mark) later made the new owner skip is
	// caught all the same.
	StaleEpochs int
	// Unfenced counts effects whose transaction did not hold the lane's
	// fence: it did not write the partition's cursor row itself, or its
	// token was not the partition's claimed epoch when it committed.
	Unfenced int

	// EventsChecked says the emitted events were compared (Check was given
	// the stream with Events); the counts below are zero otherwise.
	EventsChecked bool
	// Events counts the distinct events of the function found in the
	// outbox and the stream.
	Events int
	// MissingEvents counts applied records without an event.
	MissingEvents int
	// DuplicatedEvents counts events beyond one per applied record: a
	// second event id for one record, or one id stored twice in the stream.
	DuplicatedEvents int
	// ExtraEvents counts events of records that have no effect (never
	// applied, or dead-lettered).
	ExtraEvents int
	// WrongEvents counts events whose data is not the record's value.
	WrongEvents int
	// ReorderedEvents counts events stored in the stream before an event
	// of the same key emitted for a lower offset of the same partition.
	ReorderedEvents int

	// Examples describes a few of the violations found, for the test log.
	Examples []string
}

// OK reports whether every violation count is zero and exactly the records
// in dead (those the test knows must be dead-lettered) were dead-lettered.
// A bug that dead-letters a good record, or applies a bad one, fails it.
func (r Report) OK(dead ...Produced) bool { return len(r.Violations(dead...)) == 0 }

// Violations lists what is wrong, given the records the test expects to be
// dead-lettered; it is empty when OK holds.
func (r Report) Violations(dead ...Produced) []string {
	var out []string
	add := func(n int, what string) {
		if n != 0 {
			out = append(out, fmt.Sprintf("%d %s", n, what))
		}
	}
	add(r.Lost, "lost")
	add(r.Duplicated, "duplicated")
	add(r.Reordered, "reordered (by commit order)")
	add(r.Unexpected, "unexpected")
	add(r.StaleEpochs, "stale-token commits")
	add(r.Unfenced, "unfenced commits")
	add(r.MissingEvents, "missing events")
	add(r.DuplicatedEvents, "duplicated events")
	add(r.ExtraEvents, "extra events")
	add(r.WrongEvents, "events with the wrong data")
	add(r.ReorderedEvents, "reordered events")
	want := map[Produced]bool{}
	for _, d := range dead {
		want[d] = true
	}
	got := map[Produced]bool{}
	var wrongly []string
	for _, d := range r.DeadLettered {
		got[d] = true
		if !want[d] {
			wrongly = append(wrongly, d.String())
		}
	}
	var missing []string
	for d := range want {
		if !got[d] {
			missing = append(missing, d.String())
		}
	}
	slices.Sort(missing)
	if len(wrongly) > 0 {
		out = append(out, fmt.Sprintf("%d dead-lettered that should not be: %s", len(wrongly), short(wrongly)))
	}
	if len(missing) > 0 {
		out = append(out, fmt.Sprintf("%d not dead-lettered that should be: %s", len(missing), short(missing)))
	}
	return out
}

func short(list []string) string {
	if len(list) > 10 {
		return strings.Join(list[:10], ", ") + ", …"
	}
	return strings.Join(list, ", ")
}

func (r Report) String() string {
	s := fmt.Sprintf("expected=%d applied=%d dead_lettered=%d lost=%d duplicated=%d reordered=%d unexpected=%d stale_epochs=%d unfenced=%d",
		r.Expected, r.Applied, r.DeadLetters, r.Lost, r.Duplicated, r.Reordered, r.Unexpected, r.StaleEpochs, r.Unfenced)
	if r.Retried > 0 {
		s += fmt.Sprintf(" retried=%d", r.Retried)
	}
	if r.EventsChecked {
		s += fmt.Sprintf(" events=%d missing_events=%d duplicated_events=%d extra_events=%d wrong_events=%d reordered_events=%d",
			r.Events, r.MissingEvents, r.DuplicatedEvents, r.ExtraEvents, r.WrongEvents, r.ReorderedEvents)
	} else {
		s += " events=unchecked"
	}
	if len(r.Examples) > 0 {
		s += "\n  " + strings.Join(r.Examples, "\n  ")
	}
	return s
}

// maxExamples bounds the examples kept per kind of violation.
const maxExamples = 3

func (r *Report) example(kind string, seen map[string]int, format string, args ...any) {
	if seen[kind] < maxExamples {
		r.Examples = append(r.Examples, kind+": "+fmt.Sprintf(format, args...))
	}
	seen[kind]++
}

// Table is the quoted name of fn's effects table, for programs that write
// effects without the runtime (the naive consumer the fault tests compare
// kfn with).
func Table(fn string) string { return table(fn) }

// Option adds a check to Check.
type Option func(*options)

type options struct {
	js       jetstream.JetStream
	stream   string
	keyOrder bool
}

// KeyOrder makes Check count order per key instead of per partition, for a
// function with key-lanes (KeyConcurrency > 1), whose records of different
// keys may commit out of offset order: per partition and key, in commit
// order, each record's first effect must follow the key's earlier ones, and
// its value, "<key>#<n>" (KeyedValue), must carry the next sequence number
// n of its key after the previous effect's.
func KeyOrder() Option { return func(o *options) { o.keyOrder = true } }

// KeyedValue is the value of the n-th record (from 1) of key in a test
// whose order Check counts per key (KeyOrder).
func KeyedValue(key string, n int) []byte { return fmt.Appendf(nil, "%s#%d", key, n) }

// Events makes Check compare the events the function emitted with its
// effects: exactly one event per applied record, carrying the record's
// value, found in the outbox (not relayed yet) or in stream (relayed), and
// per key in offset order in the stream.
func Events(js jetstream.JetStream, stream string) Option {
	return func(o *options) { o.js, o.stream = js, stream }
}

// effect is one effect row.
type effect struct {
	id     int64
	key    Produced
	value  []byte
	token  *int64
	fenced bool
	lsn    int64
}

// claim is one claim of a partition from the audit log.
type claim struct {
	epoch int64
	lsn   int64
}

// Check compares what function fn did with the records produced on topic.
// Run it when the workers are stopped (or idle): it reads the effects, the
// outbox and the stream one after the other.
func Check(ctx context.Context, pool *pgxpool.Pool, fn, topic string, produced []Produced, opts ...Option) (Report, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	effects, err := readEffects(ctx, pool, fn, topic)
	if err != nil {
		return Report{}, err
	}
	dead, err := readDeadLetters(ctx, pool, fn, topic)
	if err != nil {
		return Report{}, err
	}
	claims, err := readClaims(ctx, pool, fn, topic)
	if err != nil {
		return Report{}, err
	}
	retried, err := readRetried(ctx, pool, fn, topic)
	if err != nil {
		return Report{}, err
	}
	rep := Report{Retried: len(retried)}
	seen := map[string]int{}
	byRecord := map[Produced][]effect{}
	for _, e := range effects {
		byRecord[e.key] = append(byRecord[e.key], e)
	}
	rep.Applied = len(effects)

	expected := map[Produced]bool{}
	for _, p := range produced {
		expected[p] = true
	}
	rep.Expected = len(expected)
	for k := range dead {
		rep.DeadLettered = append(rep.DeadLettered, k)
	}
	slices.SortFunc(rep.DeadLettered, compareProduced)
	rep.DeadLetters = len(rep.DeadLettered)
	for _, k := range sortedKeys(expected) {
		n := len(byRecord[k])
		switch {
		case dead[k]:
			if n > 0 {
				rep.Duplicated += n
				rep.example("duplicated", seen, "%s dead-lettered and applied %d times", k, n)
			}
		case n == 0:
			rep.Lost++
			rep.example("lost", seen, "%s has no effect and no dead letter", k)
		case n > 1:
			rep.Duplicated += n - 1
			rep.example("duplicated", seen, "%s applied %d times (tokens %s)", k, n, tokens(byRecord[k]))
		}
	}
	for _, k := range sortedKeys(byRecord) {
		if !expected[k] {
			rep.Unexpected += len(byRecord[k])
			rep.example("unexpected", seen, "%s was never produced but applied %d times", k, len(byRecord[k]))
		}
	}
	if o.keyOrder {
		rep.checkKeyOrder(effects, retried, seen)
	} else {
		rep.checkOrder(effects, retried, seen)
	}
	rep.checkTokens(effects, claims, seen)
	if o.js != nil {
		events, err := readEvents(ctx, pool, o.js, o.stream, fn, topic)
		if err != nil {
			return Report{}, err
		}
		rep.checkEvents(events, byRecord, dead, retried, seen)
	}
	return rep, nil
}

func compareProduced(a, b Produced) int {
	return cmp.Or(cmp.Compare(a.Partition, b.Partition), cmp.Compare(a.Offset, b.Offset))
}

func sortedKeys[V any](m map[Produced]V) []Produced {
	out := make([]Produced, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.SortFunc(out, compareProduced)
	return out
}

func tokens(es []effect) string {
	var out []string
	for _, e := range es {
		if e.token == nil {
			out = append(out, "none")
		} else {
			out = append(out, strconv.FormatInt(*e.token, 10))
		}
	}
	return strings.Join(out, ",")
}

// checkOrder counts, per partition in commit order, the records whose
// first effect committed after the first effect of a higher offset. Later
// effects of a record are counted as duplicates, not again here; retried
// records are applied late on purpose and left out.
func (r *Report) checkOrder(effects []effect, retried map[Produced]bool, seen map[string]int) {
	first := map[Produced]bool{}
	highest := map[int32]effect{}
	for _, e := range effects { // sorted by partition, lsn, id
		if first[e.key] || retried[e.key] {
			continue
		}
		first[e.key] = true
		if h, ok := highest[e.key.Partition]; ok && e.key.Offset < h.key.Offset {
			r.Reordered++
			r.example("reordered", seen, "%s committed after %s", e.key, h.key)
			continue
		}
		highest[e.key.Partition] = e
	}
}

// checkKeyOrder is checkOrder per partition and key (KeyOrder): the
// effects of one key, in commit order, must carry its values' sequence
// numbers in increasing order, and the offsets in increasing order.
func (r *Report) checkKeyOrder(effects []effect, retried map[Produced]bool, seen map[string]int) {
	type keyed struct {
		partition int32
		key       string
	}
	first := map[Produced]bool{}
	type last struct {
		at  Produced
		seq int
	}
	highest := map[keyed]last{}
	for _, e := range effects { // sorted by partition, lsn, id
		if first[e.key] || retried[e.key] {
			continue
		}
		first[e.key] = true
		key, n, ok := strings.Cut(string(e.value), "#")
		seq, err := strconv.Atoi(n)
		if !ok || err != nil {
			r.Reordered++
			r.example("reordered", seen, "%s carries %q, not <key>#<sequence number>", e.key, e.value)
			continue
		}
		k := keyed{e.key.Partition, key}
		if h, ok := highest[k]; ok && (seq <= h.seq || e.key.Offset < h.at.Offset) {
			r.Reordered++
			r.example("reordered", seen, "key %q: %s (#%d) committed after %s (#%d)", key, e.key, seq, h.at, h.seq)
			continue
		}
		highest[k] = last{e.key, seq}
	}
}

// checkTokens compares every effect's token with the partition's claim
// history: the epoch current when the effect committed is the largest
// epoch claimed before it in commit order.
func (r *Report) checkTokens(effects []effect, claims map[int32][]claim, seen map[string]int) {
	for _, e := range effects {
		if e.token == nil || !e.fenced {
			r.Unfenced++
			r.example("unfenced", seen, "%s committed by a transaction that did not write the cursor row (token %s)", e.key, tokens([]effect{e}))
			continue
		}
		current := int64(0)                         // no claim yet
		for _, c := range claims[e.key.Partition] { // sorted by lsn
			if c.lsn >= e.lsn {
				break
			}
			current = max(current, c.epoch)
		}
		switch {
		case *e.token < current:
			r.StaleEpochs++
			r.example("stale token", seen, "%s committed with token %d after epoch %d was claimed", e.key, *e.token, current)
		case *e.token != current:
			r.Unfenced++
			r.example("unfenced", seen, "%s committed with token %d, which was not the claimed epoch (%d) then", e.key, *e.token, current)
		}
	}
}

func readEffects(ctx context.Context, pool *pgxpool.Pool, fn, topic string) ([]effect, error) {
	rows, err := pool.Query(ctx, `
SELECT id, partition, "offset", value, token, fenced, (lsn - '0/0'::pg_lsn)::bigint
  FROM `+table(fn)+` WHERE topic = $1 ORDER BY partition, lsn, id`, topic)
	if err != nil {
		return nil, fmt.Errorf("read effects: %w", err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (effect, error) {
		var e effect
		err := row.Scan(&e.id, &e.key.Partition, &e.key.Offset, &e.value, &e.token, &e.fenced, &e.lsn)
		return e, err
	})
}

func readDeadLetters(ctx context.Context, pool *pgxpool.Pool, fn, topic string) (map[Produced]bool, error) {
	rows, err := pool.Query(ctx, `SELECT partition, "offset" FROM kfn.dead_letters WHERE consumer = $1 AND topic = $2`, fn, topic)
	if err != nil {
		return nil, fmt.Errorf("read dead letters: %w", err)
	}
	keys, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Produced])
	if err != nil {
		return nil, fmt.Errorf("read dead letters: %w", err)
	}
	dead := map[Produced]bool{}
	for _, k := range keys {
		dead[k] = true
	}
	return dead, nil
}

// readClaims reads the claim history of fn's partitions of topic (see
// inbox.ActionClaim), sorted by commit order per partition.
func readClaims(ctx context.Context, pool *pgxpool.Pool, fn, topic string) (map[int32][]claim, error) {
	rows, err := pool.Query(ctx, `
SELECT partition, (details->>'epoch')::bigint, ((details->>'lsn')::pg_lsn - '0/0'::pg_lsn)::bigint
  FROM kfn.audit_log WHERE action = $1 AND consumer = $2 AND topic = $3`, inbox.ActionClaim, fn, topic)
	if err != nil {
		return nil, fmt.Errorf("read the claim history: %w", err)
	}
	out := map[int32][]claim{}
	var p int32
	var c claim
	_, err = pgx.ForEachRow(rows, []any{&p, &c.epoch, &c.lsn}, func() error {
		out[p] = append(out[p], c)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the claim history: %w", err)
	}
	for _, cs := range out {
		slices.SortFunc(cs, func(a, b claim) int { return cmp.Compare(a.lsn, b.lsn) })
	}
	return out, nil
}

// readRetried reads which records of fn's partitions of topic a dead
// letter retry applied (inbox.ActionRetryApplied in the audit log).
func readRetried(ctx context.Context, pool *pgxpool.Pool, fn, topic string) (map[Produced]bool, error) {
	rows, err := pool.Query(ctx, `
SELECT partition, (details->>'offset')::bigint FROM kfn.audit_log WHERE action = $1 AND consumer = $2 AND topic = $3`,
		inbox.ActionRetryApplied, fn, topic)
	if err != nil {
		return nil, fmt.Errorf("read the retried records: %w", err)
	}
	keys, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Produced])
	if err != nil {
		return nil, fmt.Errorf("read the retried records: %w", err)
	}
	out := map[Produced]bool{}
	for _, k := range keys {
		out[k] = true
	}
	return out, nil
}

// event is one emitted event, from the outbox or the stream.
type event struct {
	id     string
	record Produced
	key    string
	keyed  bool // key is known (a stream message may carry none)
	data   []byte
	seq    uint64 // stream sequence; 0 if only in the outbox
}

// events are fn's events: those still in the outbox, and those in the
// stream in stream order (an id stored twice appears twice).
type events struct {
	outbox []event
	stream []event
}

// readEvents reads the outbox first and the stream second: a row the relay
// deletes in between was published before, so no event falls between.
func readEvents(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, stream, fn, topic string) (events, error) {
	var out events
	rows, err := pool.Query(ctx, `
SELECT event_id, source_partition, source_offset, event_key, data FROM kfn.outbox
 WHERE source = $1 AND source_topic = $2 AND subject = $3 ORDER BY id`, fn, topic, Subject(fn))
	if err != nil {
		return out, fmt.Errorf("read the outbox: %w", err)
	}
	out.outbox, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (event, error) {
		var e event
		var key []byte // text or bytea, whichever the schema has
		err := row.Scan(&e.id, &e.record.Partition, &e.record.Offset, &key, &e.data)
		e.key, e.keyed = string(key), true
		return e, err
	})
	if err != nil {
		return out, fmt.Errorf("read the outbox: %w", err)
	}
	out.stream, err = readStream(ctx, js, stream, fn, topic)
	return out, err
}

// readStream reads every message stored on fn's subject, duplicates
// included, with an ordered consumer.
func readStream(ctx context.Context, js jetstream.JetStream, stream, fn, topic string) ([]event, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	subject := Subject(fn)
	s, err := js.Stream(ctx, stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, nil // nothing was relayed
	}
	if err != nil {
		return nil, fmt.Errorf("read stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		return nil, fmt.Errorf("read stream %s: %w", stream, err)
	}
	total := int(info.State.Subjects[subject])
	if total == 0 {
		return nil, nil
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject}})
	if err != nil {
		return nil, fmt.Errorf("read stream %s: %w", stream, err)
	}
	out := make([]event, 0, total)
	for read := 0; read < total; {
		batch, err := cons.Fetch(min(1000, total-read), jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return nil, fmt.Errorf("read stream %s: %w", stream, err)
		}
		for m := range batch.Messages() {
			read++
			md, err := m.Metadata()
			if err != nil {
				return nil, fmt.Errorf("read stream %s: %w", stream, err)
			}
			h := m.Headers()
			if h.Get(outbox.HeaderSource) != outbox.CloudEventsSourcePrefix+fn || h.Get(outbox.HeaderSourceTopic) != topic {
				continue
			}
			e := event{id: h.Get(jetstream.MsgIDHeader), data: m.Data(), seq: md.Sequence.Stream}
			e.key, e.keyed = streamKey(h)
			p, err1 := strconv.ParseInt(h.Get(outbox.HeaderSourcePartition), 10, 32)
			o, err2 := strconv.ParseInt(h.Get(outbox.HeaderSourceOffset), 10, 64)
			if err := errors.Join(err1, err2); err != nil {
				return nil, fmt.Errorf("stream %s seq %d: source headers: %w", stream, md.Sequence.Stream, err)
			}
			e.record = Produced{Partition: int32(p), Offset: o}
			out = append(out, e)
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
			return nil, fmt.Errorf("read stream %s: %w", stream, err)
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("read stream %s: read %d of %d messages on %s", stream, read, total, subject)
		}
	}
	return out, nil
}

// streamKey is the event key a relayed message carries: the kfn-key
// header, or a key that cannot travel as a header value, base64-encoded in
// kfn-key-b64 (relays that know it).
func streamKey(h nats.Header) (string, bool) {
	if k := h.Values(outbox.HeaderKey); len(k) > 0 {
		return k[0], true
	}
	if k := h.Get("kfn-key-b64"); k != "" {
		if b, err := base64.StdEncoding.DecodeString(k); err == nil {
			return string(b), true
		}
	}
	return "", false
}

// checkEvents requires exactly one event per applied record, carrying the
// record's value, and none for records that were not applied; and per key
// and source partition, stream order following offset order (but for
// retried records, emitted late on purpose).
func (r *Report) checkEvents(evs events, byRecord map[Produced][]effect, dead, retried map[Produced]bool, seen map[string]int) {
	r.EventsChecked = true
	ids := map[Produced]map[string]bool{} // record → its distinct event ids
	data := map[string][]byte{}
	note := func(e event) {
		if ids[e.record] == nil {
			ids[e.record] = map[string]bool{}
		}
		ids[e.record][e.id] = true
		data[e.id] = e.data
	}
	for _, e := range evs.outbox {
		note(e)
	}
	stored := map[string]int{}
	for _, e := range evs.stream {
		note(e)
		stored[e.id]++
		if stored[e.id] == 2 {
			r.DuplicatedEvents++
			r.example("duplicated event", seen, "event %s of %s is stored twice in the stream", e.id, e.record)
		} else if stored[e.id] > 2 {
			r.DuplicatedEvents++
		}
	}
	for _, k := range sortedKeys(ids) {
		r.Events += len(ids[k])
	}
	applied := map[Produced]bool{}
	for k := range byRecord {
		if !dead[k] {
			applied[k] = true
		}
	}
	for _, k := range sortedKeys(applied) {
		switch n := len(ids[k]); {
		case n == 0:
			r.MissingEvents++
			r.example("missing event", seen, "%s was applied but emitted no event", k)
		case n > 1:
			r.DuplicatedEvents += n - 1
			r.example("duplicated event", seen, "%s has %d events", k, n)
		}
		for id := range ids[k] {
			if want := byRecord[k][0].value; !bytes.Equal(data[id], want) {
				r.WrongEvents++
				r.example("wrong event", seen, "event %s of %s carries %q, want %q", id, k, data[id], want)
			}
		}
	}
	for _, k := range sortedKeys(ids) {
		if !applied[k] {
			r.ExtraEvents += len(ids[k])
			r.example("extra event", seen, "%s has %d events but no effect", k, len(ids[k]))
		}
	}
	type lane struct {
		key       string
		partition int32
	}
	last := map[lane]Produced{}
	first := map[Produced]bool{}   // a record's later events are counted as duplicates
	for _, e := range evs.stream { // stream order
		if first[e.record] {
			continue
		}
		first[e.record] = true
		if !e.keyed || retried[e.record] {
			continue // no key to order by
		}
		l := lane{e.key, e.record.Partition}
		if prev, ok := last[l]; ok && e.record.Offset < prev.Offset {
			r.ReorderedEvents++
			r.example("reordered event", seen, "key %q: the event of %s is stored after that of %s", e.key, e.record, prev)
			continue
		}
		last[l] = e.record
	}
}
