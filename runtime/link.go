package runtime

import (
	"github.com/kfn-dev/kfn/internal/authorlink"
	"github.com/kfn-dev/kfn/internal/settings"
)

// The engine reaches what these types keep unexported through
// internal/authorlink.
func init() {
	authorlink.Set(authorlink.Hooks[Config, KafkaSecurity, NATSSecurity, Record, Event, Events, BatchEvents]{
		BindConfig:        func(b *settings.Binder, c *Config) { c.bind(b) },
		BoundConfig:       func(c Config) *settings.Binder { return c.bound },
		BindKafkaSecurity: func(b *settings.Binder, s *KafkaSecurity) { s.bind(b) },
		BindNATSSecurity:  func(b *settings.Binder, s *NATSSecurity) { s.bind(b) },
		NewEvents: func(rec Record, emit func(Record, Event)) *Events {
			return &Events{rec: rec, emit: emit}
		},
		NewBatchEvents: func(emit func(Record, Event)) *BatchEvents { return &BatchEvents{emit: emit} },
	})
}
