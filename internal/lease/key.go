package lease

import (
	"fmt"
	"strconv"
	"strings"
)

// Key layout inside the bucket. Every caller-supplied part is escaped into a
// single KV token, so a part can never add or remove a dot-separated level:
//
//	<group>.<item>                 a lease (two tokens)
//	members.<group>.<memberID>     a membership heartbeat (three tokens)
const membersPrefix = "members"

// leaseKey returns the bucket key of the lease on item within group.
func leaseKey(group, item string) string {
	return escapeToken(group) + "." + escapeToken(item)
}

// leaseFilter matches every lease key of group.
func leaseFilter(group string) string {
	return escapeToken(group) + ".*"
}

// memberKey returns the bucket key of memberID's heartbeat within group.
func memberKey(group, memberID string) string {
	return membersPrefix + "." + escapeToken(group) + "." + escapeToken(memberID)
}

// memberFilter matches every heartbeat key of group.
func memberFilter(group string) string {
	return membersPrefix + "." + escapeToken(group) + ".*"
}

// splitLeaseKey returns the item of a lease key of group, or false if key is
// not one.
func splitLeaseKey(group, key string) (string, bool) {
	rest, ok := strings.CutPrefix(key, escapeToken(group)+".")
	if !ok || strings.Contains(rest, ".") {
		return "", false
	}
	item, err := unescapeToken(rest)
	return item, err == nil
}

// splitMemberKey returns the member ID of a heartbeat key of group, or false
// if key is not one.
func splitMemberKey(group, key string) (string, bool) {
	rest, ok := strings.CutPrefix(key, membersPrefix+"."+escapeToken(group)+".")
	if !ok || strings.Contains(rest, ".") {
		return "", false
	}
	id, err := unescapeToken(rest)
	return id, err == nil
}

// escapeToken makes s a single valid KV key token. Letters, digits, '-', '/'
// and '=' are kept, so common names ("orders/3") stay readable; every other
// byte, including '.' and the escape byte '_', becomes "_XX" (upper-case hex).
// The mapping is injective, so distinct names never share a key.
func escapeToken(s string) string {
	var b strings.Builder
	b.Grow(len(s))
	for i := 0; i < len(s); i++ {
		c := s[i]
		if tokenSafe(c) {
			b.WriteByte(c)
			continue
		}
		fmt.Fprintf(&b, "_%02X", c)
	}
	return b.String()
}

func unescapeToken(s string) (string, error) {
	if !strings.Contains(s, "_") {
		return s, nil
	}
	var b strings.Builder
	b.Grow(len(s))
	for i := 0; i < len(s); i++ {
		if s[i] != '_' {
			b.WriteByte(s[i])
			continue
		}
		if i+2 >= len(s) {
			return "", fmt.Errorf("unescape key token %q: truncated escape at %d", s, i)
		}
		c, err := strconv.ParseUint(s[i+1:i+3], 16, 8)
		if err != nil {
			return "", fmt.Errorf("unescape key token %q at %d: %w", s, i, err)
		}
		b.WriteByte(byte(c))
		i += 2
	}
	return b.String(), nil
}

func tokenSafe(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
		c == '-' || c == '/' || c == '='
}
