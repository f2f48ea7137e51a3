// Package authorlink lets the engine reach what package runtime keeps
// unexported in the author's types, without exporting it to authors:
// where a Config was bound (its flags' bad values), how its settings bind
// to flags, and the emit hook of Events and BatchEvents. Package runtime
// sets the hooks in its init; the engine, and the internal packages that
// bind the security settings, get them with Get. It is not a stable API.
package authorlink

import "github.com/kfn-dev/kfn/internal/settings"

// Hooks are package runtime's ways in. The type parameters are runtime's
// Config, KafkaSecurity, NATSSecurity, Record, Event, Events and
// BatchEvents.
type Hooks[Config, KafkaSecurity, NATSSecurity, Record, Event, Events, BatchEvents any] struct {
	// BindConfig binds every setting of c to b (Config.Bind).
	BindConfig func(b *settings.Binder, c *Config)
	// BoundConfig is the Binder c was bound with, or nil: its Errors are
	// the bad values given to c's settings.
	BoundConfig func(c Config) *settings.Binder
	// BindKafkaSecurity and BindNATSSecurity bind the security settings.
	BindKafkaSecurity func(b *settings.Binder, s *KafkaSecurity)
	BindNATSSecurity  func(b *settings.Binder, s *NATSSecurity)
	// NewEvents and NewBatchEvents return the Events and BatchEvents a
	// worker hands its handler: emit gets each event as it is emitted,
	// with the record it is emitted for.
	NewEvents      func(rec Record, emit func(Record, Event)) *Events
	NewBatchEvents func(emit func(Record, Event)) *BatchEvents
}

var hooks any

// Set installs h; package runtime calls it once, in its init.
func Set[C, K, N, R, E, EV, BE any](h Hooks[C, K, N, R, E, EV, BE]) { hooks = h }

// Get returns the hooks package runtime installed; it panics if the type
// parameters are not runtime's types.
func Get[C, K, N, R, E, EV, BE any]() Hooks[C, K, N, R, E, EV, BE] {
	return hooks.(Hooks[C, K, N, R, E, EV, BE])
}
