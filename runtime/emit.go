package runtime

import (
	"fmt"
	"strings"

	"github.com/kfn-dev/kfn/outbox"
)

// emitCollector gathers the outbox rows of one transaction. Each source
// record numbers its events from 0, so event ids are deterministic.
type emitCollector struct {
	consumer string
	rows     []outbox.Row
	next     map[string]int // next emit index per source record
	err      error          // first invalid event; fails the handler
}

func newEmitCollector(consumer string) *emitCollector {
	return &emitCollector{consumer: consumer, next: map[string]int{}}
}

func (c *emitCollector) emit(rec Record, ev Event) {
	if err := validateSubject(ev.Subject); err != nil {
		if c.err == nil {
			c.err = Permanent(fmt.Errorf("emit from %s: %w", rec, err))
		}
		return
	}
	sourceID := outbox.KafkaSourceID(rec.Topic, rec.Partition, rec.Offset)
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
