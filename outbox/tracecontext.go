package outbox

import (
	"strings"

	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
)

// W3C Trace Context (https://www.w3.org/TR/trace-context/) and Baggage
// (https://www.w3.org/TR/baggage/) headers. The worker reads them from a
// source record, continues the record's trace in its handler's span, and
// writes that span's context into the events emitted for the record
// (Origin); the relay continues it on the JetStream message. A value from
// a record that does not follow the format is not propagated: it may hold
// any byte a producer put there, and a wrong trace context is worse than
// none.
const (
	HeaderTraceParent = "traceparent"
	HeaderTraceState  = "tracestate"
	HeaderBaggage     = "baggage"
)

// Propagator reads and writes the W3C trace context and baggage headers:
// the OpenTelemetry propagator kfn uses on records, outbox rows and
// JetStream messages. Feed it only validated values (ValidTraceParent,
// ValidTraceState, ValidBaggage) from outside.
var Propagator propagation.TextMapPropagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// ValidBaggage reports whether s is a W3C baggage header value that can be
// propagated as a whole: valid header text that OpenTelemetry parses
// without error (at most 180 members and 8192 bytes).
func ValidBaggage(s string) bool {
	if !ValidHeaderValue(s) {
		return false
	}
	_, err := baggage.Parse(s)
	return err == nil
}

// ValidTraceParent reports whether s is a W3C traceparent a version-00
// tracer accepts:
//
//	version "-" trace-id "-" parent-id "-" trace-flags
//	00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
//
// all lowercase hex; the trace id and parent id not all zeros; version ff
// invalid. A version above 00 may carry more fields after the flags,
// separated by "-"; version 00 may not.
func ValidTraceParent(s string) bool {
	if len(s) < 55 || !lowerHex(s[0:2]) || s[0:2] == "ff" ||
		s[2] != '-' || !lowerHex(s[3:35]) || s[3:35] == strings.Repeat("0", 32) ||
		s[35] != '-' || !lowerHex(s[36:52]) || s[36:52] == strings.Repeat("0", 16) ||
		s[52] != '-' || !lowerHex(s[53:55]) {
		return false
	}
	if s[0:2] == "00" {
		return len(s) == 55
	}
	return len(s) == 55 || s[55] == '-'
}

func lowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// maxTraceStateMembers is the W3C limit on tracestate list members.
const maxTraceStateMembers = 32

// ValidTraceState reports whether s is a W3C tracestate: at most 32
// comma-separated list members "key=value" (optional spaces and tabs around
// each; empty members allowed), each key unique, where a key is
//
//	lcalpha 0*255( lcalpha / DIGIT / "_" / "-" / "*" / "/" )
//	or tenant "@" system: ( lcalpha / DIGIT ) 0*240( … ) "@" lcalpha 0*13( … )
//
// and a value is 1 to 256 printable ASCII characters other than "," and
// "=", not ending in a space.
func ValidTraceState(s string) bool {
	members := 0
	seen := map[string]bool{}
	for _, m := range strings.Split(s, ",") {
		m = strings.Trim(m, " \t")
		if m == "" {
			continue
		}
		members++
		key, value, ok := strings.Cut(m, "=")
		if !ok || members > maxTraceStateMembers || seen[key] || !validTraceStateKey(key) || !validTraceStateValue(value) {
			return false
		}
		seen[key] = true
	}
	return true
}

func validTraceStateKey(k string) bool {
	keyChar := func(c byte) bool {
		return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '*' || c == '/'
	}
	allKeyChars := func(s string) bool {
		for i := 0; i < len(s); i++ {
			if !keyChar(s[i]) {
				return false
			}
		}
		return true
	}
	tenant, system, multi := strings.Cut(k, "@")
	if !multi {
		return len(k) >= 1 && len(k) <= 256 && k[0] >= 'a' && k[0] <= 'z' && allKeyChars(k)
	}
	return len(tenant) >= 1 && len(tenant) <= 241 && (tenant[0] >= 'a' && tenant[0] <= 'z' || tenant[0] >= '0' && tenant[0] <= '9') && allKeyChars(tenant) &&
		len(system) >= 1 && len(system) <= 14 && system[0] >= 'a' && system[0] <= 'z' && allKeyChars(system)
}

func validTraceStateValue(v string) bool {
	if len(v) < 1 || len(v) > 256 || v[len(v)-1] == ' ' {
		return false
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < 0x20 || c > 0x7e || c == ',' || c == '=' {
			return false
		}
	}
	return true
}
