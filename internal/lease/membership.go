package lease

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// memberValue is the JSON stored under a heartbeat key.
type memberValue struct {
	Member string    `json:"member"`
	At     time.Time `json:"at"`
}

// Heartbeat marks memberID as live in group for one TTL. It is a plain write:
// the bucket's MaxAge removes the key of a member that stops writing it.
func (s *Store) Heartbeat(ctx context.Context, group, memberID string) error {
	key := memberKey(group, memberID)
	data, err := json.Marshal(memberValue{Member: memberID, At: time.Now().UTC()})
	if err != nil {
		return fmt.Errorf("heartbeat %s: encode: %w", key, err)
	}
	rev, err := s.kv.Put(ctx, key, data)
	if err != nil {
		return fmt.Errorf("heartbeat %s: %w", key, err)
	}
	s.noteRevision(rev)
	return nil
}

// Leave removes memberID's heartbeat, so that the others rebalance at once
// instead of after TTL.
func (s *Store) Leave(ctx context.Context, group, memberID string) error {
	key := memberKey(group, memberID)
	if err := s.kv.Delete(ctx, key); err != nil {
		return fmt.Errorf("leave %s: %w", key, err)
	}
	return nil
}

// Members lists the live members of group (those whose heartbeat key is
// present and not outlived, see outlived), sorted.
func (s *Store) Members(ctx context.Context, group string) ([]string, error) {
	w, err := s.kv.WatchFiltered(ctx, []string{memberFilter(group)}, jetstream.IgnoreDeletes(), jetstream.MetaOnly())
	if err != nil {
		return nil, fmt.Errorf("list members of %s: %w", group, err)
	}
	defer func() { _ = w.Stop() }()
	var members []string
	for {
		select {
		case <-ctx.Done():
			// A partial list must not look like members leaving.
			return nil, fmt.Errorf("list members of %s: %w", group, ctx.Err())
		case e, ok := <-w.Updates():
			if !ok {
				// The watcher also closes its channel when ctx ends.
				if err := ctx.Err(); err != nil {
					return nil, fmt.Errorf("list members of %s: %w", group, err)
				}
				return nil, fmt.Errorf("list members of %s: the watch ended before its last key", group)
			}
			if e == nil { // every key the bucket held is listed
				slices.Sort(members)
				return slices.Compact(members), nil
			}
			if id, ok := splitMemberKey(group, e.Key()); ok && !s.outlived(e) {
				members = append(members, id)
			}
		}
	}
}

// outlived reports whether a heartbeat was written more than two TTLs
// plus outlivedSkew ago: the bucket's MaxAge (one TTL) should have removed
// it long since. A replica that missed the expiry keeps serving such a key
// (seen here after a whole NATS cluster restarted under load: a member
// killed two minutes earlier came and went from the listings for half a
// minute, and its lanes were handed to it again and again; nats-server
// issues 3653 and 4754 report the same). Counting it as live would give a
// dead member items. The allowance covers clocks of this host and the
// NATS servers that disagree.
func (s *Store) outlived(e jetstream.KeyValueEntry) bool {
	return s.now().Sub(e.Created()) > 2*s.cfg.TTL+outlivedSkew
}

// outlivedSkew is how far this host's clock may be ahead of the NATS
// servers' before a live heartbeat looks outlived.
const outlivedSkew = 10 * time.Second

// memberPresent reports whether memberID's heartbeat key is in the bucket,
// and not outlived. A listing can miss a key that is rewritten while it
// runs (it is deleted from under the listing's consumer and written again
// past its end), so a member missing from a listing is asked for directly
// before it counts as gone.
func (s *Store) memberPresent(ctx context.Context, group, memberID string) (bool, error) {
	e, err := s.kv.Get(ctx, memberKey(group, memberID))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read heartbeat of %s in %s: %w", memberID, group, err)
	}
	s.noteRevision(e.Revision())
	return !s.outlived(e), nil
}

// eventKind classifies a watched change.
type eventKind int

const (
	memberUp eventKind = iota + 1
	memberDown
	leaseFree
)

// event is a change seen by the watch that the Manager reacts to.
type event struct {
	kind     eventKind
	name     string // member ID or item
	revision uint64 // of the entry: for leaseFree, the delete or expiry marker
}

// watchGroup watches the heartbeats and leases of group and returns the
// changes the Manager reacts to: members appearing or going, and leases
// being deleted or expiring. Lease renewals are not reported. The channel is
// closed when the watch ends (ctx done, or the subscription closed).
func (s *Store) watchGroup(ctx context.Context, group string) (<-chan event, error) {
	w, err := s.kv.WatchFiltered(ctx, []string{memberFilter(group), leaseFilter(group)},
		jetstream.UpdatesOnly(), jetstream.MetaOnly())
	if err != nil {
		return nil, fmt.Errorf("watch %s: %w", group, err)
	}
	out := make(chan event, 64)
	go func() {
		// Unsubscribing asks the server to delete the consumer and can wait
		// for the JetStream timeout while NATS is down, so the reader is
		// released first.
		defer func() { _ = w.Stop() }()
		defer close(out)
		for {
			var e jetstream.KeyValueEntry
			var ok bool
			select {
			case <-ctx.Done():
				return
			case e, ok = <-w.Updates():
				if !ok {
					return
				}
			}
			if e == nil {
				continue
			}
			s.noteRevision(e.Revision())
			ev, ok := classify(group, e)
			if !ok {
				continue
			}
			// The watcher's delivery blocks while we do, so never wait on
			// the reader: a dropped event is caught by the periodic pass.
			select {
			case out <- ev:
			default:
			}
		}
	}()
	return out, nil
}

func classify(group string, e jetstream.KeyValueEntry) (event, bool) {
	gone := e.Operation() == jetstream.KeyValueDelete || e.Operation() == jetstream.KeyValuePurge
	if id, ok := splitMemberKey(group, e.Key()); ok {
		if gone {
			return event{kind: memberDown, name: id}, true
		}
		return event{kind: memberUp, name: id}, true
	}
	if item, ok := splitLeaseKey(group, e.Key()); ok && gone {
		return event{kind: leaseFree, name: item, revision: e.Revision()}, true
	}
	return event{}, false
}
