package runtime

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/kfn-dev/kfn/outbox"
)

// emitCollector gathers the outbox rows of one transaction. Each source
// record numbers its events from 0, so event ids are deterministic.
type emitCollector struct {
	consumer   string
	emits      []string // the function's declared subjects
	generation int      // the partition's re-execution count; see inbox.ReplayRequest
	rows       []outbox.Row
	next       map[string]int // next emit index per source record
	err        error          // first invalid event; fails the handler
}

func newEmitCollector(fn Function, generation int) *emitCollector {
	return &emitCollector{consumer: fn.Name, emits: fn.Emits, generation: generation, next: map[string]int{}}
}

func (c *emitCollector) emit(rec Record, ev Event) {
	err := validateSubject(ev.Subject)
	if err == nil && !outbox.CoversSubject(c.emits, ev.Subject) {
		err = fmt.Errorf("event subject %q is not among the function's Emits %v: declare it there", ev.Subject, c.emits)
	}
	if err != nil {
		if c.err == nil {
			c.err = Permanent(fmt.Errorf("emit from %s: %w", rec, err))
		}
		return
	}
	sourceID := outbox.KafkaSourceID(rec.Topic, rec.Partition, rec.Offset)
	if rec.EventID != "" {
		sourceID = "event/" + rec.EventID
	}
	if c.generation > 0 {
		// A re-executed record emits events with new ids, so downstream
		// inboxes apply them instead of skipping them as repeats.
		sourceID += "#" + strconv.Itoa(c.generation)
	}
	index := c.next[sourceID]
	c.next[sourceID] = index + 1
	traceParent, _ := rec.Header("traceparent")
	origin := outbox.Origin{
		Consumer: c.consumer, Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset,
		SourceID: sourceID, TraceParent: string(traceParent),
	}
	c.rows = append(c.rows, outbox.NewRow(origin, index, string(rec.Key), ev))
}

// validateSubject rejects subjects NATS cannot publish on.
func validateSubject(s string) error {
	if s == "" {
		return fmt.Errorf("event has no Subject")
	}
	for _, tok := range strings.Split(s, ".") {
		if tok == "" || tok == "*" || tok == ">" || strings.ContainsAny(tok, " \t\r\n") {
			return fmt.Errorf("event subject %q is not a valid NATS subject for publishing", s)
		}
	}
	return nil
}

// validateSubjectPattern rejects Emits entries that are not subjects or
// subject wildcards ("orders.*", "orders.>").
func validateSubjectPattern(s string) error {
	tokens := strings.Split(s, ".")
	for i, tok := range tokens {
		if tok == "" || strings.ContainsAny(tok, " \t\r\n") || (tok == ">" && i != len(tokens)-1) ||
			(len(tok) > 1 && strings.ContainsAny(tok, "*>")) {
			return fmt.Errorf("%q is not a valid NATS subject or wildcard", s)
		}
	}
	return nil
}
