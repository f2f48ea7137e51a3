package pgdata_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"unicode/utf8"

	"github.com/kfn-dev/kfn/internal/pgdata"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

func TestTextEscapesNULAndInvalidUTF8Only(t *testing.T) {
	cases := []struct{ in, want string }{
		{"", ""},
		{"plain\nmulti-line\ttext", "plain\nmulti-line\ttext"},
		{"héllo ✓", "héllo ✓"},
		{"a\x00b", `a\x00b`},
		{"invalid character '\x00' looking for value", `invalid character '\x00' looking for value`},
		{"\xff\xfe", `\xff\xfe`},
		{"ok\xc3", `ok\xc3`},             // truncated two-byte sequence
		{"\xed\xa0\x80", `\xed\xa0\x80`}, // an encoded surrogate is not UTF-8
		{"\x00\x01", `\x00` + "\x01"},    // other control bytes are valid text
	}
	for _, c := range cases {
		got := pgdata.Text(c.in)
		if got != c.want {
			t.Errorf("Text(%q) = %q, want %q", c.in, got, c.want)
		}
		if !pgdata.ValidText(got) {
			t.Errorf("Text(%q) = %q is not valid text", c.in, got)
		}
		if pgdata.ValidText(c.in) != (c.in == c.want) {
			t.Errorf("ValidText(%q) = %v", c.in, pgdata.ValidText(c.in))
		}
	}
}

// TestTextIsAcceptedByPostgresAndDataErrorsAreClassified writes every byte
// value, and random byte strings, through Text into a real text column, and
// checks which real Postgres errors IsDataError charges to the data.
func TestTextIsAcceptedByPostgresAndDataErrorsAreClassified(t *testing.T) {
	pg := kfntest.Postgres(t)
	ctx := context.Background()
	if _, err := pg.Pool.Exec(ctx, `CREATE TABLE t (s text, j jsonb, n integer CHECK (n < 10))`); err != nil {
		t.Fatal(err)
	}
	var inputs []string
	for b := 0; b < 256; b++ {
		inputs = append(inputs, string([]byte{byte(b)}), "x"+string([]byte{byte(b), 'y'}))
	}
	for i := 0; i < 200; i++ {
		s := make([]byte, i%37)
		for j := range s {
			s[j] = byte((i*131 + j*29) % 256)
		}
		inputs = append(inputs, string(s))
	}
	for _, in := range inputs {
		var back string
		if err := pg.Pool.QueryRow(ctx, `INSERT INTO t (s) VALUES ($1) RETURNING s`, pgdata.Text(in)).Scan(&back); err != nil {
			t.Fatalf("insert Text(%q): %v", in, err)
		}
		if back != pgdata.Text(in) || !utf8.ValidString(back) {
			t.Fatalf("Text(%q) came back as %q", in, back)
		}
	}

	_, nulText := pg.Pool.Exec(ctx, `INSERT INTO t (s) VALUES ($1)`, "a\x00b")
	_, badUTF8 := pg.Pool.Exec(ctx, `INSERT INTO t (s) VALUES ($1)`, "a\xffb")
	_, nulJSON := pg.Pool.Exec(ctx, `INSERT INTO t (j) VALUES ($1)`, map[string]string{"k\x00": "v"})
	_, check := pg.Pool.Exec(ctx, `INSERT INTO t (n) VALUES (11)`)
	_, syntax := pg.Pool.Exec(ctx, `INSERT INTO nowhere VALUES (1)`)
	for name, err := range map[string]error{"NUL in text": nulText, "invalid UTF-8 in text": badUTF8, "NUL in jsonb": nulJSON, "check constraint": check} {
		if err == nil || !pgdata.IsDataError(err) {
			t.Errorf("%s: IsDataError(%v) = false, want true", name, err)
		}
		if !pgdata.IsDataError(fmt.Errorf("wrapped: %w", err)) {
			t.Errorf("%s: a wrapped data error is not classified", name)
		}
	}
	for name, err := range map[string]error{"undefined table": syntax, "not a Postgres error": errors.New("connection refused"), "nil": nil} {
		if pgdata.IsDataError(err) {
			t.Errorf("%s: IsDataError(%v) = true, want false", name, err)
		}
	}
}
