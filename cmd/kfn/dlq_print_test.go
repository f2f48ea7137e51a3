package main

import "testing"

func TestDLQShowsRecordBytesPrintableOrHex(t *testing.T) {
	cases := []struct {
		in   []byte
		want string
	}{
		{nil, "-"},
		{[]byte{}, ""},
		{[]byte("order-7"), "order-7"},
		{[]byte("clé ✓"), "clé ✓"},
		{[]byte("\x00\x00\x00\x00\x2a"), "0x000000002a"},
		{[]byte("a\xffb"), "0x61ff62"},
		{[]byte("tab\there"), "0x7461620968657265"},
		{[]byte("a=b"), "0x613d62"}, // '=' would blur name=value
		{[]byte("0123456789012345678901234567890123456789-and-more"), "0123456789012345678901234567890123456789…(49 bytes)"},
	}
	for _, c := range cases {
		if got := printable(c.in); got != c.want {
			t.Errorf("printable(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}
