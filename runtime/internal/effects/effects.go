// Package effects is the test function and the checker behind kfn's
// exactly-once tests. The function records one row per applied record in a
// table with no unique key, so a duplicate apply shows up as a second row,
// and it misbehaves on request (transient errors, permanent errors, panics)
// according to the record's value. The checker compares the effects with
// what was produced and counts lost, duplicated and reordered effects.
package effects

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/runtime"
)

// Commands a record's value can carry. Anything else is applied as is.
const (
	Permanent  = "permanent" // fail permanently: dead-lettered at once
	Panic      = "panic"     // panic on every attempt: dead-lettered after the retries
	Always     = "always"    // fail on every attempt: dead-lettered after the retries
	FailPrefix = "fail-"     // "fail-N": fail the first N attempts, then succeed
	JSONPrefix = "{"         // must decode as JSON; malformed JSON is a permanent error
)

// Subject is the subject of the event emitted for each applied record.
func Subject(fn string) string { return "effects." + fn }

// Function returns a function named name that consumes topic and writes
// effects into table effects_<name>, one record at a time.
func Function(name, topic string) runtime.Function {
	return runtime.Function{
		Name:  name,
		Topic: topic,
		Emits: []string{Subject(name)},
		Setup: setup(name),
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			if err := apply(ctx, tx, name, rec); err != nil {
				return err
			}
			out.Emit(runtime.Event{Subject: Subject(name), Data: rec.Value})
			return nil
		},
	}
}

// BatchFunction is Function with a batch handler: one handler call per batch.
func BatchFunction(name, topic string) runtime.Function {
	return runtime.Function{
		Name:  name,
		Topic: topic,
		Emits: []string{Subject(name)},
		Setup: setup(name),
		BatchHandler: func(ctx context.Context, tx pgx.Tx, recs []runtime.Record, out *runtime.BatchEvents) error {
			for _, rec := range recs {
				if err := apply(ctx, tx, name, rec); err != nil {
					return err
				}
				out.Emit(rec, runtime.Event{Subject: Subject(name), Data: rec.Value})
			}
			return nil
		},
	}
}

func table(name string) string { return pgx.Identifier{"effects_" + name}.Sanitize() }

func setup(name string) func(ctx context.Context, tx pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table(name)+` (
    id        bigserial PRIMARY KEY,
    topic     text    NOT NULL,
    partition integer NOT NULL,
    "offset"  bigint  NOT NULL,
    value     bytea,
    attempt   integer NOT NULL
)`)
		return err
	}
}

// apply misbehaves as the record's value asks, or records the effect.
func apply(ctx context.Context, tx pgx.Tx, name string, rec runtime.Record) error {
	v := string(rec.Value)
	switch {
	case v == Permanent:
		return runtime.Permanent(errors.New("asked to fail permanently"))
	case v == Panic:
		panic("asked to panic")
	case v == Always:
		return errors.New("asked to fail every time")
	case strings.HasPrefix(v, FailPrefix):
		n, err := strconv.Atoi(strings.TrimPrefix(v, FailPrefix))
		if err != nil {
			return runtime.Permanent(fmt.Errorf("bad fail count: %w", err))
		}
		if rec.Attempt <= n {
			return fmt.Errorf("transient failure %d of %d", rec.Attempt, n)
		}
	case strings.HasPrefix(v, JSONPrefix):
		var doc map[string]any
		if err := json.Unmarshal(rec.Value, &doc); err != nil {
			return runtime.Permanent(fmt.Errorf("decode JSON: %w", err))
		}
	}
	_, err := tx.Exec(ctx, `INSERT INTO `+table(name)+` (topic, partition, "offset", value, attempt) VALUES ($1, $2, $3, $4, $5)`,
		rec.Topic, rec.Partition, rec.Offset, rec.Value, rec.Attempt)
	return err
}
