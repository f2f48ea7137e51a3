package engine

import (
	"errors"
	"fmt"

	"github.com/kfn-dev/kfn/internal/authorlink"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// The author's types (Function, Record, Events…) are package runtime's,
// imported as kfn; link reaches what they keep unexported.
var link = authorlink.Get[kfn.Config, kfn.KafkaSecurity, kfn.NATSSecurity, kfn.Record, kfn.Event, kfn.Events, kfn.BatchEvents]()

// DefaultStream is the JetStream stream outbox events are relayed to.
const DefaultStream = settings.DefaultEventStream

// newEvents returns the Events a handler gets for rec, whose events go to
// emit as they are emitted.
func newEvents(rec kfn.Record, emit func(kfn.Record, kfn.Event)) *kfn.Events {
	return link.NewEvents(rec, emit)
}

// newBatchEvents returns the BatchEvents a batch handler gets, whose events
// go to emit as they are emitted.
func newBatchEvents(emit func(kfn.Record, kfn.Event)) *kfn.BatchEvents {
	return link.NewBatchEvents(emit)
}

// Source is the lane name a function's records come from: its topic, or
// its subject.
func Source(f kfn.Function) string {
	if f.Subject != "" {
		return f.Subject
	}
	return f.Topic
}

// validateFunction checks f before a worker runs it.
func validateFunction(f kfn.Function) error {
	switch {
	case f.Name == "":
		return errors.New("function: Name is empty")
	case !validName(f.Name):
		return fmt.Errorf("function: Name %q may only contain letters, digits, '-' and '_'", f.Name)
	case f.Topic == "" && f.Subject == "":
		return fmt.Errorf("function %s: set Topic (a Kafka topic) or Subject (a JetStream subject)", f.Name)
	case f.Topic != "" && f.Subject != "":
		return fmt.Errorf("function %s: set only one of Topic and Subject", f.Name)
	case f.Handler == nil && f.BatchHandler == nil:
		return fmt.Errorf("function %s: set Handler or BatchHandler", f.Name)
	case f.Handler != nil && f.BatchHandler != nil:
		return fmt.Errorf("function %s: set only one of Handler and BatchHandler", f.Name)
	case f.PipelineExecs && f.Handler == nil:
		return fmt.Errorf("function %s: PipelineExecs applies to a Handler: a BatchHandler sends its own statements", f.Name)
	case f.KeyOrder != kfn.Continue && f.KeyOrder != kfn.ParkKey:
		return fmt.Errorf("function %s: KeyOrder %v is neither Continue nor ParkKey", f.Name, f.KeyOrder)
	case f.KeyConcurrency < 0 || f.KeyConcurrency > settings.MaxKeyConcurrency:
		return fmt.Errorf("function %s: KeyConcurrency %d is out of range 0..%d (0 and 1: one lane per partition)", f.Name, f.KeyConcurrency, settings.MaxKeyConcurrency)
	case f.KeyOrder == kfn.ParkKey && f.Subject != "":
		return fmt.Errorf("function %s: KeyOrder ParkKey is supported for Kafka-triggered functions (Topic) only", f.Name)
	}
	for _, s := range f.Emits {
		if err := outbox.CheckSubjectPattern(s); err != nil {
			return fmt.Errorf("function %s: Emits: %w", f.Name, err)
		}
	}
	return nil
}

func validName(s string) bool {
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}
