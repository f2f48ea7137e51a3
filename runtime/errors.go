package runtime

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// PermanentError marks a failure that retrying cannot fix, such as a payload
// that does not decode. The record is dead-lettered at once.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err so that the record is dead-lettered without retries:
// for a failure no retry can fix, such as a payload that does not decode.
// Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err (or an error it wraps) is permanent.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

// DecodeJSON decodes a record's value as one JSON value of type T, strictly:
// unknown fields, trailing data and an empty value are errors. A value that
// does not decode is a Permanent error, as no retry can fix it: returned
// from a handler, it dead-letters the record at once.
func DecodeJSON[T any](value []byte) (T, error) {
	var v T
	if len(bytes.TrimSpace(value)) == 0 {
		return v, Permanent(fmt.Errorf("decode %T JSON: the value is empty", v))
	}
	dec := json.NewDecoder(bytes.NewReader(value))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		return v, Permanent(fmt.Errorf("decode %T JSON: %w", v, err))
	}
	if _, err := dec.Token(); err != io.EOF {
		return v, Permanent(fmt.Errorf("decode %T JSON: data after the JSON value", v))
	}
	return v, nil
}
