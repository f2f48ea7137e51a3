package operator

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/kfn-dev/kfn/inbox"
)

// A filter value that cannot match anything is a mistake of the caller,
// not an empty answer: the CLI refuses it (exit 2) and says what exists.
// Cannot match means: an audit action or a dead letter reason outside
// their closed sets (AuditActions, inbox.DeadLetterReasons), a function
// kfn has never seen (no cursor, no NATS lane, no dead letter, no audit
// row: a worker's first lease claim writes its cursor, so every function
// that ever ran anywhere has one), or a partition of a topic that has
// neither a cursor nor a dead letter while other partitions of it do.

// AuditActions are the actions kfn writes to kfn.audit_log.
var AuditActions = []string{
	"replay", "reexecute", "park", inbox.ActionDiscard, inbox.ActionPurge, "skip_expired", inbox.ActionClaim,
	"lanes_changed", inbox.ActionKeyReleased, inbox.ActionRetryRequested, inbox.ActionRetryApplied, inbox.ActionRetryFailed,
}

// UnknownFilterError is a filter value that cannot match: Flag is the
// filter, Value what was given, Known what would match (nil when the set
// is too large or unknown).
type UnknownFilterError struct {
	Flag, Value, What string
	Known             []string
}

func (e *UnknownFilterError) Error() string {
	msg := fmt.Sprintf("--%s %q: no %s", e.Flag, e.Value, e.What)
	switch {
	case e.Known == nil:
	case len(e.Known) == 0:
		msg += " (there are none yet)"
	default:
		msg += ": use one of " + strings.Join(e.Known, ", ")
	}
	return msg
}

// CheckAuditAction refuses an action kfn never writes.
func CheckAuditAction(action string) error {
	if action == "" || slices.Contains(AuditActions, action) {
		return nil
	}
	return &UnknownFilterError{Flag: "action", Value: action, What: "such audit action", Known: AuditActions}
}

// CheckFunction refuses a function kfn has never seen; "" (every
// function) passes.
func CheckFunction(ctx context.Context, db inbox.Querier, function string) error {
	if function == "" {
		return nil
	}
	var known bool
	err := db.QueryRow(ctx, `
SELECT EXISTS (SELECT 1 FROM kfn.cursors WHERE consumer = $1)
    OR EXISTS (SELECT 1 FROM kfn.subject_lanes WHERE consumer = $1)
    OR EXISTS (SELECT 1 FROM kfn.dead_letters WHERE consumer = $1)
    OR EXISTS (SELECT 1 FROM kfn.audit_log WHERE consumer = $1)`, function).Scan(&known)
	if err != nil || known {
		return err
	}
	names, err := KnownFunctions(ctx, db)
	if err != nil {
		return err
	}
	return &UnknownFilterError{Flag: "function", Value: function, What: "function with a cursor, a lane or a dead letter", Known: names}
}

// KnownFunctions lists the functions that have a cursor, a NATS lane or
// a dead letter.
func KnownFunctions(ctx context.Context, db inbox.Querier) ([]string, error) {
	rows, err := db.Query(ctx, `
SELECT consumer FROM kfn.cursors
 UNION SELECT consumer FROM kfn.subject_lanes
 UNION SELECT DISTINCT consumer FROM kfn.dead_letters ORDER BY 1`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	names := []string{}
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			return nil, err
		}
		names = append(names, n)
	}
	return names, rows.Err()
}

// CheckPartition refuses a partition of topic (of function, when given)
// that has neither a cursor nor a dead letter while others do: a number
// beyond the topic's. A negative partition (every partition) passes, and
// so does any partition of a topic kfn knows nothing of.
func CheckPartition(ctx context.Context, db inbox.Querier, function, topic string, partition int32) error {
	if partition < 0 || topic == "" {
		return nil
	}
	rows, err := db.Query(ctx, `
SELECT partition FROM kfn.cursors WHERE topic = $1 AND ($2 = '' OR consumer = $2)
 UNION SELECT DISTINCT partition FROM kfn.dead_letters WHERE topic = $1 AND ($2 = '' OR consumer = $2)
 ORDER BY 1`, topic, function)
	if err != nil {
		return err
	}
	defer rows.Close()
	var parts []string
	found := false
	for rows.Next() {
		var p int32
		if err := rows.Scan(&p); err != nil {
			return err
		}
		found = found || p == partition
		parts = append(parts, fmt.Sprint(p))
	}
	if err := rows.Err(); err != nil || found || len(parts) == 0 {
		return err
	}
	return &UnknownFilterError{Flag: "partition", Value: fmt.Sprint(partition), What: "cursor or dead letter on that partition of " + topic, Known: parts}
}
