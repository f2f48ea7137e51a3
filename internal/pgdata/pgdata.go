// Package pgdata owns the two rules for record content on its way into
// Postgres: which text kfn may write into a text column (Text, ValidText),
// and which Postgres errors a record's content caused rather than the
// infrastructure (IsDataError).
//
// A record is bytes: its key, value and header names and values may hold
// NUL, invalid UTF-8 or anything else. kfn stores those as bytea. Only text
// kfn composes itself goes into text columns (an error message, which may
// quote a record's value), and it goes through Text first.
package pgdata

import (
	"errors"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
)

// Text makes s storable in a Postgres text column of a UTF-8 database: every
// NUL byte and every byte that is not part of valid UTF-8 is written as the
// four characters \xNN. Everything else, line breaks included, is kept. The
// result is for people to read (an error message); it is not reversible.
func Text(s string) string {
	if ValidText(s) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 16)
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1, r == 0:
			b.WriteString(`\x`)
			b.WriteByte(hexDigits[s[i]>>4])
			b.WriteByte(hexDigits[s[i]&0xf])
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

const hexDigits = "0123456789abcdef"

// ValidText reports whether a Postgres text column stores s exactly as it
// is: valid UTF-8 without NUL bytes.
func ValidText(s string) bool {
	return utf8.ValidString(s) && strings.IndexByte(s, 0) < 0
}

// IsDataError reports whether err is a Postgres error about the data a
// statement carried rather than about the database being reachable or
// healthy: SQLSTATE class 22 (data exception: NUL or invalid UTF-8 in text
// or JSON, a value out of range), class 23 (integrity constraint violation)
// and 54000 (a value over a size limit). When kfn's own write of a record's
// data fails this way, retrying the same record can never succeed, so the
// failure is charged to the record (retried alone, then dead-lettered) and
// never retried as an infrastructure error.
func IsDataError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "23") || pgErr.Code == "54000"
}
