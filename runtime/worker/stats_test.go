package worker

import (
	"reflect"
	"sync/atomic"
	"testing"

	"github.com/kfn-dev/kfn/internal/observe"
)

// TestStatsShowEveryCounterOfTheEngine fails when the engine counts
// something that Worker.Stats does not show, or shows a copy of it.
func TestStatsShowEveryCounterOfTheEngine(t *testing.T) {
	var es observe.Stats
	s := newStats(&es)
	ev, sv := reflect.ValueOf(&es).Elem(), reflect.ValueOf(s).Elem()
	counter := reflect.TypeFor[atomic.Int64]()
	for i := range ev.NumField() {
		f := ev.Type().Field(i)
		if !f.IsExported() || f.Type != counter {
			continue
		}
		got := sv.FieldByName(f.Name)
		if !got.IsValid() {
			t.Errorf("worker.Stats has no %s", f.Name)
			continue
		}
		if p, ok := got.Interface().(*atomic.Int64); !ok || p != ev.Field(i).Addr().Interface().(*atomic.Int64) {
			t.Errorf("worker.Stats.%s is not the engine's counter", f.Name)
		}
	}
	es.Applied.Add(3)
	if s.Applied.Load() != 3 {
		t.Errorf("Applied = %d after the engine counted 3", s.Applied.Load())
	}
}
