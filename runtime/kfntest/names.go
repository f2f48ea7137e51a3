package kfntest

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
)

// runID tells apart test binaries that share a real Kafka, NATS or Postgres.
var runID = func() string {
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}()

var nameSeq atomic.Uint64

// maxNameLen keeps names within every limit that applies to them: NATS
// stream, bucket and consumer names, Kafka topics (249) and, after the
// database prefix, Postgres identifiers (63).
const maxNameLen = 60

// Name returns a name that is unique within this test run and across test
// binaries, built from prefix and the test's name. It contains only letters,
// digits, '-' and '_', so it is valid as a Kafka topic, a NATS JetStream
// stream, KV bucket or consumer name.
func Name(t testing.TB, prefix string) string {
	suffix := fmt.Sprintf("-%s%d", runID, nameSeq.Add(1))
	base := sanitizeName(t.Name())
	if p := sanitizeName(prefix); p != "" {
		base = p + "-" + base
	}
	if room := maxNameLen - len(suffix); len(base) > room {
		base = base[:room]
	}
	return base + suffix
}

// sanitizeName keeps letters, digits, '-' and '_' and turns everything else
// (subtest slashes, spaces, dots) into '_'.
func sanitizeName(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
	}
	return b.String()
}
