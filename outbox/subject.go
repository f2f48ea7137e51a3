package outbox

import (
	"fmt"
	"strings"

	"github.com/kfn-dev/kfn/internal/pgdata"
)

// This file holds kfn's rules for NATS subjects, for everyone who checks
// one: the subjects an event is published on, the subject patterns a
// function declares it emits on (Function.Emits) or a stream captures, and
// whether a pattern covers a subject.

// CheckSubject returns an error unless s is a subject an event can be
// published on: valid UTF-8 text without NUL bytes (it is stored in
// kfn.outbox), non-empty tokens separated by dots, no whitespace, no
// wildcard.
func CheckSubject(s string) error {
	if s == "" {
		return fmt.Errorf("event has no Subject")
	}
	if !pgdata.ValidText(s) {
		return fmt.Errorf("event subject %q is not valid UTF-8 text without NUL bytes", s)
	}
	if !wellFormedSubject(s, false) {
		return fmt.Errorf("event subject %q is not a valid NATS subject for publishing", s)
	}
	return nil
}

// CheckSubjectPattern returns an error unless s is a subject or a subject
// wildcard ("orders.*", "orders.>"): '*' and '>' only as whole tokens, '>'
// only last.
func CheckSubjectPattern(s string) error {
	if !wellFormedSubject(s, true) {
		return fmt.Errorf("%q is not a valid NATS subject or wildcard", s)
	}
	return nil
}

func wellFormedSubject(s string, wildcards bool) bool {
	if s == "" || strings.ContainsAny(s, " \t\r\n") {
		return false
	}
	tokens := strings.Split(s, ".")
	for i, t := range tokens {
		switch {
		case t == "":
			return false
		case (t == "*" || t == ">") && !wildcards:
			return false
		case t == ">" && i != len(tokens)-1:
			return false
		case len(t) > 1 && strings.ContainsAny(t, "*>"):
			return false
		}
	}
	return true
}

// CoversSubject reports whether one of patterns matches every subject
// that subject (itself possibly a wildcard) matches.
func CoversSubject(patterns []string, subject string) bool {
	for _, p := range patterns {
		if subjectCovers(p, subject) {
			return true
		}
	}
	return false
}

// subjectCovers walks pattern and subject token by token without
// splitting them: the WAL relay asks for every event it publishes, and
// the two slices strings.Split made were its only allocations there.
func subjectCovers(pattern, subject string) bool {
	for {
		p, pRest, pMore := strings.Cut(pattern, ".")
		if p == ">" {
			return true // and subject has a token left here: '>' needs one
		}
		s, sRest, sMore := strings.Cut(subject, ".")
		switch {
		case p == "*":
			if s == ">" {
				return false
			}
		case p != s:
			return false
		}
		if !pMore || !sMore {
			return pMore == sMore
		}
		pattern, subject = pRest, sRest
	}
}
