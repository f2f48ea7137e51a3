package lease

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

var (
	// ErrHeld is returned by Acquire when another holder has the lease.
	ErrHeld = errors.New("lease is held by another owner")
	// ErrLost is returned when a lease is no longer this holder's: its
	// validity ran out, it expired, was released, or was seized.
	ErrLost = errors.New("lease lost")
	// ErrNotHeld is returned by Holder when nobody holds the lease.
	ErrNotHeld = errors.New("lease is not held")
	// ErrBucketNew is returned by Acquire for a while after the bucket was
	// lost and created again: until every lease of the lost bucket has run
	// out (TTL-SafetyMargin after it was noticed), nobody acquires, so that
	// two holders never overlap.
	ErrBucketNew = errors.New("lease bucket was created again recently; waiting until the leases of the lost bucket have run out")
)

// leaseValue is the JSON stored under a lease key.
type leaseValue struct {
	Owner      string    `json:"owner"`
	AcquiredAt time.Time `json:"acquired_at"`
	// Token is the revision that started the term. It is unknown when the
	// term's first write is made, so it is written from the first renewal
	// on.
	Token  uint64 `json:"token,omitempty"`
	Seized bool   `json:"seized,omitempty"`
	// Instance identifies the Manager run that wrote the term, so that the
	// run can recognise terms of its own that no work uses any more.
	Instance string `json:"instance,omitempty"`
}

// Lease is one holder's term on one item. Its Token is the revision written
// when the term began (by Acquire or Seize) and never changes during the
// term; renewals write newer revisions, which only the Lease itself tracks
// for compare-and-set. A Lease is not safe for concurrent use.
type Lease struct {
	Group string
	Item  string
	Owner string
	// Token is the fencing token of this term. Tokens are stream sequence
	// numbers of the bucket, so a later term always has a larger token.
	Token uint64
	// AcquiredAt is the holder's wall-clock time at the start of the term.
	AcquiredAt time.Time

	key        string
	value      leaseValue
	revision   uint64
	validUntil time.Time // monotonic; zero once released
}

// Revision returns the revision of the lease's latest successful write.
func (l *Lease) Revision() uint64 { return l.revision }

// ValidUntil returns when the holder must stop using the lease if no renewal
// succeeds before: the send time of the last successful write plus
// TTL - SafetyMargin, on the holder's monotonic clock.
func (l *Lease) ValidUntil() time.Time { return l.validUntil }

// Valid reports whether the lease may still be used now.
func (l *Lease) Valid() bool { return time.Now().Before(l.validUntil) }

func (s *Store) validity(sent time.Time) time.Time {
	return sent.Add(s.cfg.TTL - s.cfg.SafetyMargin)
}

func (s *Store) newLease(group, item string, v leaseValue, rev uint64, sent time.Time) *Lease {
	return &Lease{
		Group: group, Item: item, Owner: v.Owner,
		Token: rev, AcquiredAt: v.AcquiredAt,
		key: leaseKey(group, item), value: v, revision: rev,
		validUntil: s.validity(sent),
	}
}

// Acquire starts a term on item for owner if nobody holds it. It returns
// ErrHeld if the key exists.
func (s *Store) Acquire(ctx context.Context, group, item, owner string) (*Lease, error) {
	return s.acquire(ctx, group, item, owner, "", 0)
}

// acquire is Acquire for a Manager run (instance). freedAt, when not 0, is
// the revision of the delete or expiry marker the watch showed for the key.
func (s *Store) acquire(ctx context.Context, group, item, owner, instance string, freedAt uint64) (*Lease, error) {
	key := leaseKey(group, item)
	v := leaseValue{Owner: owner, AcquiredAt: time.Now().UTC(), Instance: instance}
	data, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("acquire lease %s: encode: %w", key, err)
	}
	if err := s.checkFresh(ctx); err != nil {
		return nil, fmt.Errorf("acquire lease %s: %w", key, err)
	}
	sent := time.Now()
	rev, err := s.create(ctx, key, data, freedAt)
	if CreateConflict(err) {
		return nil, fmt.Errorf("acquire lease %s: %w", key, ErrHeld)
	}
	if err != nil {
		return nil, fmt.Errorf("acquire lease %s: %w", key, err)
	}
	s.noteRevision(rev)
	// The bucket may have been lost and created again between the check
	// and the Create. Then the Create landed in a new bucket while holders
	// of the lost one may still work: undo it.
	if err := s.checkFresh(ctx); err != nil {
		if derr := s.kv.Delete(ctx, key, jetstream.LastRevision(rev)); derr != nil {
			s.log.Warn("delete a lease acquired while the bucket was created again; it expires after TTL", "key", key, "err", derr)
		}
		return nil, fmt.Errorf("acquire lease %s: %w", key, err)
	}
	return s.newLease(group, item, v, rev, sent), nil
}

// create writes key if it is absent or its latest entry is a delete or
// expiry marker, as KeyValue.Create does. Create on a key that was deleted
// (every lease handed off) is three round trips: a write expecting no
// entry, a read of the marker, a write expecting the marker. With freedAt,
// the marker's revision seen by the watch, one write expecting it does;
// if it is not the key's latest entry any more, Create decides.
func (s *Store) create(ctx context.Context, key string, data []byte, freedAt uint64) (uint64, error) {
	if freedAt > 0 {
		if rev, err := s.kv.Update(ctx, key, data, freedAt); err == nil {
			return rev, nil
		}
	}
	return s.kv.Create(ctx, key, data)
}

// CreateConflict reports whether a KV Create failed because another writer
// got the key first. nats.go maps most such replies to ErrKeyExists, but
// not one race: when the key was deleted, Create retries at the delete
// marker's revision, and if another writer wins that retry the server's
// "wrong last sequence" comes back unmapped (code 10164 on a replicated
// bucket, 10071 on one replica).
func CreateConflict(err error) bool {
	if errors.Is(err, jetstream.ErrKeyExists) {
		return true
	}
	var api *jetstream.APIError
	return errors.As(err, &api) && (api.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		api.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}

// reclaimOwn deletes the lease on item if its current term was written by
// instance, and reports whether it did. The Manager calls it only for items
// on which it runs no work, so such a term is abandoned: one whose holder
// gave it up while NATS was unreachable, or an acquire whose reply never
// came (nats.go may send requests buffered during a disconnection after the
// caller gave up on them). Without this the item would stay unowned until
// the term expires. The delete is conditional on the revision read, so it
// can never remove another holder's term.
func (s *Store) reclaimOwn(ctx context.Context, group, item, instance string) (bool, error) {
	key := leaseKey(group, item)
	e, err := s.kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read lease %s: %w", key, err)
	}
	s.noteRevision(e.Revision())
	var v leaseValue
	if err := json.Unmarshal(e.Value(), &v); err != nil || instance == "" || v.Instance != instance {
		return false, nil
	}
	err = s.kv.Delete(ctx, key, jetstream.LastRevision(e.Revision()))
	if errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("delete abandoned lease %s revision %d: %w", key, e.Revision(), err)
	}
	return true, nil
}

// Seize starts a term on item for owner whether or not someone holds it: an
// unconditional write whose new, larger revision is the token. A current
// holder's next renewal fails and it stops; a worker still inside a batch is
// stopped by Postgres once the new token is recorded there. The replay CLI
// uses this to fence the partition's owner.
func (s *Store) Seize(ctx context.Context, group, item, owner string) (*Lease, error) {
	key := leaseKey(group, item)
	v := leaseValue{Owner: owner, AcquiredAt: time.Now().UTC(), Seized: true}
	data, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("seize lease %s: encode: %w", key, err)
	}
	sent := time.Now()
	rev, err := s.kv.Put(ctx, key, data)
	if err != nil {
		return nil, fmt.Errorf("seize lease %s: %w", key, err)
	}
	s.noteRevision(rev)
	return s.newLease(group, item, v, rev, sent), nil
}

// Renew extends l by writing it again, conditional on its latest revision.
// It returns ErrLost if l's validity already ran out or the key is gone or
// belongs to another term; other errors (timeouts, NATS down) leave l as it
// was and may be retried while l is still valid.
func (s *Store) Renew(ctx context.Context, l *Lease) error {
	if !l.Valid() {
		return fmt.Errorf("renew lease %s token %d: validity ran out: %w", l.key, l.Token, ErrLost)
	}
	v := l.value
	v.Token = l.Token
	data, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("renew lease %s: encode: %w", l.key, err)
	}
	sent := time.Now()
	rev, err := s.kv.Update(ctx, l.key, data, l.revision)
	if errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		// Either the term ended, or an earlier renewal whose reply was lost
		// was applied after all. The stored value tells which.
		e, gerr := s.kv.Get(ctx, l.key)
		switch {
		case errors.Is(gerr, jetstream.ErrKeyNotFound):
			return fmt.Errorf("renew lease %s token %d: key is gone: %w", l.key, l.Token, ErrLost)
		case gerr != nil:
			return fmt.Errorf("renew lease %s token %d: revision moved, read back: %w", l.key, l.Token, gerr)
		case !sameTerm(e, l):
			return fmt.Errorf("renew lease %s token %d: now revision %d of another term: %w", l.key, l.Token, e.Revision(), ErrLost)
		}
		sent = time.Now()
		rev, err = s.kv.Update(ctx, l.key, data, e.Revision())
	}
	if err != nil {
		return fmt.Errorf("renew lease %s token %d: %w", l.key, l.Token, err)
	}
	s.noteRevision(rev)
	l.revision = rev
	l.validUntil = s.validity(sent)
	return nil
}

// sameTerm reports whether the stored entry was written by l's term.
func sameTerm(e jetstream.KeyValueEntry, l *Lease) bool {
	var v leaseValue
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		return false
	}
	if v.Owner != l.Owner || !v.AcquiredAt.Equal(l.AcquiredAt) || v.Seized != l.value.Seized {
		return false
	}
	return v.Token == l.Token || v.Token == 0 && e.Revision() == l.Token
}

// Release ends l's term by deleting the key, conditional on l's latest
// revision, so that another member can acquire it at once. l is invalid
// afterwards whatever the outcome. It returns ErrLost if the key had already
// moved on (expired, or seized).
func (s *Store) Release(ctx context.Context, l *Lease) error {
	l.validUntil = time.Time{}
	err := s.kv.Delete(ctx, l.key, jetstream.LastRevision(l.revision))
	if errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return fmt.Errorf("release lease %s token %d: %w", l.key, l.Token, ErrLost)
	}
	if err != nil {
		return fmt.Errorf("release lease %s token %d: %w", l.key, l.Token, err)
	}
	return nil
}

// HolderInfo describes the current term of a lease, for status displays.
type HolderInfo struct {
	Owner string
	// Token is the fencing token of the current term.
	Token uint64
	// Revision is the latest write of the term (the last renewal).
	Revision uint64
	// AcquiredAt is the holder's wall-clock time at the start of the term.
	AcquiredAt time.Time
	// RenewedAt is the server's time of the latest write.
	RenewedAt time.Time
	// Seized is set for terms started by Seize.
	Seized bool
}

// Age returns how long the term has lasted, by the local clock.
func (h HolderInfo) Age() time.Duration { return time.Since(h.AcquiredAt) }

// Holder reads who holds the lease on item. It returns ErrNotHeld if nobody
// does.
func (s *Store) Holder(ctx context.Context, group, item string) (HolderInfo, error) {
	key := leaseKey(group, item)
	e, err := s.kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return HolderInfo{}, fmt.Errorf("read lease %s: %w", key, ErrNotHeld)
	}
	if err != nil {
		return HolderInfo{}, fmt.Errorf("read lease %s: %w", key, err)
	}
	s.noteRevision(e.Revision())
	var v leaseValue
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		return HolderInfo{}, fmt.Errorf("read lease %s: decode revision %d: %w", key, e.Revision(), err)
	}
	h := HolderInfo{Owner: v.Owner, Token: v.Token, Revision: e.Revision(), AcquiredAt: v.AcquiredAt, RenewedAt: e.Created(), Seized: v.Seized}
	if h.Token == 0 {
		h.Token = e.Revision() // not renewed yet: the first write is the term's
	}
	return h, nil
}
