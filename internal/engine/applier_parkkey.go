package engine

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"sync/atomic"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// Parking by key (Function.KeyOrder = ParkKey), the lane's side; the store
// is inbox/parkkey.go.
//
// Blocking. When a lane dead-letters a record R of key K (in a batch's
// transaction for an oversized record, in deadLetter's for a handler
// failure), the same transaction writes K's row in kfn.parked_keys, with R's
// offset as the blocking offset.
//
// Parking. A lane keeps its partition's held keys in memory (heldKeys): the
// blocked ones and the released ones whose parked records are still marked
// for retry. Only the lane, under its fence, blocks keys of its partition;
// other processes only release them. So the memory holds every key held in
// the database, and maybe more: a key is added before its transaction
// commits (a commit whose reply is lost cannot leave it out), and dropped
// only when the database says it is free. A batch's transaction checks the
// batch's keys that the memory holds against the database
// (inbox.CheckHeldKeys, under a lock that a release waits for); a record of
// a key held there is dead-lettered with reason key_parked instead of
// reaching the handler, and, when its key is released, marked for retry
// behind the key's other parked records. A record whose key the memory does
// not hold reaches the handler without a query.
//
// Releasing. A blocker's retry that succeeds (retry_lane.go), a discard or a
// purge deletes the key's row and marks its key_parked letters for retry in
// the transaction that deletes the blocking letter. The lane applies marked
// letters in offset order, one transaction each. A parked letter whose
// retry fails blocks the key at its own offset and unmarks the key's later
// parked letters in the transaction that records the failure; a parked
// letter is never applied while an earlier one blocks its key
// (inbox.ParkedBehind, checked in the retry's transaction).
//
// Order, for key K on partition P. Let b be K's first dead-lettered record.
// Every later record of K reaches the handler only when K is free in the
// database inside that record's transaction, which needs every earlier
// record of K applied or discarded: while b's letter exists, K is blocked
// (a row), and after it goes, K stays held while any of its parked letters
// is marked; one that fails blocks K again before the next is taken. The
// parked letters themselves are applied by the lane, one at a time, in
// offset order. So K's records are applied in offset order, skipping only
// those an operator discarded.

// heldKeys is a Kafka lane's view of the held keys of its partition: key →
// its blocking offset (or, for a released key, its first marked letter's).
// Only the lane's goroutine uses it; count is read by the retry watcher.
type heldKeys struct {
	keys    map[string]inbox.HeldKey
	count   atomic.Int64
	publish func(n int) // the per-partition stats, for kfn_parked_keys
}

func newHeldKeys(publish func(n int)) *heldKeys {
	return &heldKeys{keys: map[string]inbox.HeldKey{}, publish: publish}
}

func (h *heldKeys) has(key []byte) bool {
	_, ok := h.keys[string(key)]
	return ok
}

// load replaces the view with what the database says.
func (h *heldKeys) load(list []inbox.HeldKey) {
	clear(h.keys)
	for _, k := range list {
		h.keys[string(k.Key)] = k
	}
	h.changed()
}

// list returns the held keys.
func (h *heldKeys) list() []inbox.HeldKey {
	out := make([]inbox.HeldKey, 0, len(h.keys))
	for _, k := range h.keys {
		out = append(out, k)
	}
	return out
}

func (h *heldKeys) set(k inbox.HeldKey) {
	h.keys[string(k.Key)] = k
	h.changed()
}

func (h *heldKeys) drop(keys []string) {
	if len(keys) == 0 {
		return
	}
	for _, k := range keys {
		delete(h.keys, k)
	}
	h.changed()
}

func (h *heldKeys) changed() {
	h.count.Store(int64(len(h.keys)))
	if h.publish != nil {
		h.publish(len(h.keys))
	}
}

// reload reads the held keys of the lane's partition again.
func (a *applier) reloadHeld(ctx context.Context) error {
	if a.held == nil {
		return nil
	}
	list, err := inbox.HeldKeys(ctx, a.pool, a.part)
	if err != nil {
		return err
	}
	a.held.load(list)
	return nil
}

// checkHeld returns, inside a batch's transaction tx, the keys of fresh
// that are held in the database, and the keys the memory held that the
// database says are free. It returns a nil map when the function does not
// park keys, and asks the database nothing when the memory holds none of
// the batch's keys.
func (a *applier) checkHeld(ctx context.Context, tx pgx.Tx, fresh []kfn.Record) (held map[string]inbox.HeldKey, checked []string, err error) {
	if a.held == nil {
		return nil, nil, nil
	}
	held = map[string]inbox.HeldKey{}
	var keys [][]byte
	seen := map[string]bool{}
	for _, r := range fresh {
		if r.Key != nil && !seen[string(r.Key)] && a.held.has(r.Key) {
			seen[string(r.Key)] = true
			keys = append(keys, r.Key)
			checked = append(checked, string(r.Key))
		}
	}
	if len(keys) == 0 {
		return held, nil, nil
	}
	list, err := inbox.CheckHeldKeys(ctx, tx, a.part, keys)
	if err != nil {
		return nil, nil, err
	}
	for _, k := range list {
		held[string(k.Key)] = k
	}
	return held, checked, nil
}

// parks reports whether rec waits behind its key in held (from checkHeld),
// and behind which offset.
func parks(held map[string]inbox.HeldKey, rec kfn.Record) (inbox.HeldKey, bool) {
	if held == nil || rec.Key == nil {
		return inbox.HeldKey{}, false
	}
	k, ok := held[string(rec.Key)]
	return k, ok && (k.Released || k.Offset < rec.Offset)
}

// parkKey blocks rec's key behind rec inside tx, which dead-letters rec,
// when the function parks keys and rec has a key. The memory holds the key
// from now on, whether tx commits or not.
func (a *applier) parkKey(ctx context.Context, tx pgx.Tx, rec kfn.Record, held map[string]inbox.HeldKey) error {
	if a.held == nil || rec.Key == nil {
		return nil
	}
	if err := inbox.ParkKey(ctx, tx, a.part, rec.Key, rec.Offset); err != nil {
		return err
	}
	k := inbox.HeldKey{Key: rec.Key, Offset: rec.Offset}
	if held != nil {
		held[string(rec.Key)] = k
	}
	a.held.set(k)
	return nil
}

// heldBackError is a key_parked letter's retry that was not run: its key
// is parked behind an earlier dead letter.
type heldBackError struct{ blockingOffset int64 }

func (e *heldBackError) Error() string { return inbox.HeldBackMessage(e.blockingOffset) }

// errRetryOversized is a letter whose record is too large to rebuild.
var errRetryOversized = errors.New("oversized")

// retryFailureReason is the reason a parked letter whose retry failed with
// cause gets as its key's blocker.
func retryFailureReason(cause error) string {
	if errors.Is(cause, errRetryOversized) {
		return "oversized"
	}
	return failureReason(cause)
}

// keyParkedError is the error of a record parked behind k.
func keyParkedError(k inbox.HeldKey) error {
	return errors.New(inbox.KeyParkedError(k.Offset))
}

// describeKey names a key in logs: as text when it is printable UTF-8, as
// 0x-hex otherwise, cut to 64 bytes.
func describeKey(key []byte) string {
	cut := ""
	if len(key) > 64 {
		key, cut = key[:64], "…"
	}
	if utf8.Valid(key) && !bytes.ContainsFunc(key, func(r rune) bool { return !unicode.IsPrint(r) }) {
		return string(key) + cut
	}
	return "0x" + hex.EncodeToString(key) + cut
}
