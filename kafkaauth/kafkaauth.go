// Package kafkaauth lets an opt-in module add a SASL mechanism to kfn's
// Kafka connections without kfn itself depending on what that mechanism
// needs. A function's main imports such a module for its side effect, and
// --kafka-sasl-mechanism then names the mechanism it registered:
//
//	import _ "github.com/kfn-dev/kfn/kafkaauth/mskiam" // AWS_MSK_IAM
//
// github.com/kfn-dev/kfn/kafkaauth/mskiam is the one kfn ships: Amazon
// MSK's IAM access control, in a Go module of its own, so that the AWS SDK
// reaches only the binaries that import it (docs/production/kafka.md).
// The mechanisms kfn builds in (PLAIN, SCRAM and OAUTHBEARER) need no
// registration.
package kafkaauth

import (
	"context"
	"sync"

	"github.com/segmentio/kafka-go/sasl"
)

// NewMechanism returns the SASL mechanism of a set of Kafka connections.
// kfn calls it when it builds the connections of a worker or a command,
// and calls the mechanism's Start for each connection it opens, so that a
// mechanism can sign each login afresh (kafka-go passes the broker's host
// in the context: sasl.MetadataFromContext).
type NewMechanism func(ctx context.Context) (sasl.Mechanism, error)

var (
	mu         sync.RWMutex
	mechanisms = map[string]NewMechanism{}
)

// Register makes the SASL mechanism name (as --kafka-sasl-mechanism
// spells it, e.g. "AWS_MSK_IAM") available; call it from an init
// function. A second registration of a name replaces the first.
func Register(name string, newMechanism NewMechanism) {
	mu.Lock()
	defer mu.Unlock()
	mechanisms[name] = newMechanism
}

// Lookup returns the registered mechanism named name.
func Lookup(name string) (NewMechanism, bool) {
	mu.RLock()
	defer mu.RUnlock()
	m, ok := mechanisms[name]
	return m, ok
}
