// Package lease owns who works on what. It keeps leases on items (Kafka
// partitions, outbox relay shards) in a JetStream KV bucket, and each
// lease's revision is the fencing token that Postgres checks. It also keeps
// the membership heartbeats of the workers. Its Manager assigns items to
// live members by rendezvous hashing and runs one goroutine per lease it
// holds.
//
// # Bucket
//
// One KV bucket (file storage, History 1, MaxAge = TTL, expiry markers on)
// holds two kinds of key. Each name is escaped into a single key token, so
// names may contain dots:
//
//	<group>.<item>              a lease: {"owner", "acquired_at", "token", "instance"}
//	members.<group>.<memberID>  a heartbeat, rewritten every RenewEvery
//
// The bucket's MaxAge removes any key that is not rewritten within TTL.
// That one rule expires both dead members and unrenewed leases. Every
// member of a bucket must use the same TTL, and OpenStore refuses a bucket
// that has another. A listing of the heartbeats can miss a key that is
// rewritten while it runs (measured: 2–5% of listings while heartbeats are
// written every few milliseconds), so a member missing from a listing is
// read directly before it counts as gone; a real departure (a delete or an
// expiry marker) is also seen at once through the watch.
//
// The Store creates the bucket's stream itself, laid out exactly as
// jetstream.CreateKeyValue lays out a bucket (a test compares them), because
// that API cannot set where the stream's sequence starts: the first
// revision of a bucket is above its token base (see "Bucket lost"), which
// the stream's metadata records as kfn_token_base (with kfn_token_floor and
// kfn_token_seen, where it came from). Buckets made before bases existed
// have none, and their revisions simply go on (base 0).
//
// # States of a claim
//
//	acquiring ──Create ok──► held ◄──► renewing: Update(key, value, last revision) every RenewEvery
//	    │                      │
//	    │ key exists           ├─ work returned, lease still valid ─────► released: Delete(key, last revision)
//	    ▼                      └─ validity ran out, or the key is gone ──► lost: work's ctx cancelled,
//	  retry every RenewEvery,     or belongs to another term               nothing deleted
//	  and at once when the key
//	  is deleted or expires
//
// In detail:
//
//   - Acquiring: Create writes the key only if it is absent, or if its
//     latest entry is a delete or expiry marker. The revision it returns is
//     the claim's token.
//   - Held: work(ctx, Claim{Item, Token}) runs in its own goroutine.
//   - Renewing: Update(key, value, lastRevision) is a compare-and-set. The
//     new revision becomes lastRevision, but the token does not change (see
//     below). A renewal whose reply was lost but which the server applied is
//     recognised by the stored term (owner, acquired_at, token), and the
//     next renewal continues from it.
//   - Released: the work has returned (it was told to stop, or it ended on
//     its own) while the lease was still valid. Delete(LastRevision) frees
//     the key at once, and the next owner, watching the key, Creates it
//     within milliseconds.
//   - Lost: the holder's validity ran out, or a renewal found the key gone
//     or taken by another term (expired, or seized). The work's ctx is
//     cancelled and nothing is deleted.
//
// The work's ctx is also cancelled when the item is assigned to another
// member, when items() stops listing it, or when Run's ctx ends. The lease
// is renewed until the work returns, so that it can finish its in-flight
// batch, and is then released. And it is cancelled when the member is
// unhealthy (see "Health"); then the lease is no longer renewed, only
// released once the work returns.
//
// # The timing argument: the holder stops first
//
// A holder sends a write (Create, Update or Put) at time s on its own
// monotonic clock. The server stores it later, at s' ≥ s, and stamps it
// with its own wall-clock time. Three facts follow:
//
//  1. The server removes the key no earlier than TTL after s'. Its file
//     store expires a message once now − stamp ≥ MaxAge. Its expiry timer
//     runs late, never early: by 0.04–0.35 s, measured on nats-server
//     2.15.3. Until the key is removed, every other Create fails.
//  2. The holder treats the lease as valid only until s + TTL −
//     SafetyMargin. A watchdog timer cancels the work's ctx at that moment,
//     whatever a renewal in flight is doing. The renewal's own deadline is
//     the same moment.
//  3. s ≤ s', so the holder stops at least SafetyMargin before anyone else
//     can Create the key.
//
// Durations are measured on the holder's monotonic clock, and expiry on the
// server's wall clock. The argument needs two things. First, over about one
// TTL, the two clocks must not drift apart by more than the margin; rate
// drift is parts per million, so the real risk is the server's wall clock
// being stepped forward. Second, the holder must notice its deadline
// within the margin. A pause longer than that breaks the second (GC, CPU
// starvation, SIGSTOP, a suspended VM), and a clock step breaks the first.
// Neither can be ruled out, and that is why the token exists.
//
// # Health
//
// A member that holds a lease but cannot do the work (for kfn: it cannot
// reach Postgres, while NATS answers) would otherwise keep renewing and hold
// its items for as long as the fault lasts. Config.Healthy is the work's
// say on that. It is asked every RenewEvery/4 by Run's loop, before every
// renewal and before acquiring; while it reports an error the member steps
// out:
//
//   - it deletes its heartbeat and writes none, so the others drop it from
//     the assignment at once (a watched delete), as if it had left;
//   - it renews no lease, cancels every claim's work with the error as cause,
//     and releases (deletes) each lease as soon as the work returns, while
//     the lease is still valid. The next owner, watching the key, takes it
//     within milliseconds instead of after TTL. If the work does not return
//     within the validity, the lease is lost as usual and expires;
//   - it acquires nothing.
//
// Once Healthy reports nil again the member writes its heartbeat, the
// assignment counts it again, and its share comes back by clean handoffs.
// Safety does not depend on the hook: a member that is wrongly healthy is
// still stopped by the watchdog and the fence.
//
// # Tokens and fencing
//
// KV revisions are sequence numbers of the bucket's stream, shared by all of
// its keys, so every write gets a larger one than every write before it.
// The token of a claim is the revision of the write that started its term:
// Create, or Seize's unconditional Put. Renewals write newer revisions but
// keep the token, because the token names an ownership term rather than a
// write. Postgres stores it once per term: claiming a partition sets
// epoch = T only if T > epoch, and every batch commit checks epoch = T. A
// token that changed on every renewal would force a Postgres write per
// renewal and fail commits that raced a renewal. Later terms always have
// larger tokens, so the check orders owners without any clock.
//
// The lease alone is not enough. The timing argument keeps a holder that
// runs normally from overlapping its successor. A paused holder can wake
// after its successor started, with a commit already on its way. Only the
// place where the write lands can refuse it, and Postgres does that by
// comparing tokens (invariant I4).
//
// # Failures
//
//   - Holder crash (SIGKILL). Nothing is renewed or released. The heartbeat
//     and the leases expire TTL after their last writes. The other members
//     see the expiry markers through their watch (or the next re-listing),
//     recompute the assignment and Create the freed keys, with larger
//     tokens. Measured with the defaults: 5.2–5.3 s from the holder's
//     connection closing to the new owner's claim. That is up to 6.3 s after
//     the holder's last renewal.
//   - Holder paused (SIGSTOP zombie). Its keys expire and another member
//     takes over with a larger token, which it writes to Postgres. On
//     SIGCONT the monotonic clock has moved on, so the watchdog fires at
//     once. A goroutine may still run first and try to commit, and the
//     epoch check rejects that commit. The next renewal finds the key gone
//     or owned by another term, and the claim is lost.
//   - NATS down. Every write fails. Each holder stops its claims
//     TTL − SafetyMargin after its last successful renewal (tested), and
//     nothing is acquired in the meantime. Run keeps writing heartbeats
//     every RenewEvery and retries acquires with backoff (up to
//     2×RenewEvery). nats.go reconnects (use nats.MaxReconnects(-1)), and
//     the claims come back with larger tokens.
//   - NATS restart with a file store. Keys and the stream's last sequence
//     survive, so tokens keep growing (tested with SIGKILL and an outage
//     longer than TTL). With expiry markers on, the server does not expire
//     keys when it recovers. Keys that aged out during the outage stay until
//     TTL after the restart, and nats.go may deliver acquires that were
//     buffered during the outage after their callers gave up. Each Run
//     writes its instance ID into its terms and deletes, by
//     compare-and-set, its own terms that no work is using. So the claims
//     return within about 0.1 s of the server (tested), and not after
//     another TTL.
//   - Bucket lost (deleted, a memory store, a wiped disk). Every write
//     fails (nats.go retries "no responders" until its deadline), so each
//     holder stops at TTL − SafetyMargin after its last renewal, and the
//     membership loop of every member asks the server whether the bucket
//     exists. The first member to find it missing creates it again, with
//     its stream's first sequence at base + 1, where base is the larger of
//     TokenFloor (the largest token the work stored; kfn: max(epoch) of
//     kfn.cursors) and the largest revision this Store saw, plus
//     TokenMargin (default 2^32). Why every new token is
//     larger than every token ever stored: a stored token is a revision of
//     some earlier bucket instance, and by induction each instance started
//     above all the ones before it, so it is at most the lost bucket's last
//     revision. That last revision is at most a few RenewEvery of writes
//     past the largest revision the creating member saw (it wrote a
//     heartbeat every RenewEvery until the loss), and 2^32 covers any
//     write rate for far longer than that. A member that never saw the lost
//     bucket (a process started after the loss) waits TTL − SafetyMargin
//     first, so that members that saw it can create it, and so that every
//     holder of the lost bucket that is not paused has stored its token or
//     given it up; then it reads the floor and, if the bucket is still
//     missing, creates it from the floor alone. (A holder paused across all
//     of this with a token 2^32 revisions past every stored epoch would win
//     its lane back on waking, and its successor's claims would be refused
//     until revisions pass it: a liveness risk only, since the fence still
//     orders every commit.) Creation is a single stream create, atomic on the server: when
//     several members create at once the first wins, the others get "name
//     in use" and open that bucket, whatever base it has, since every base
//     they compute is safe. Every member notices that the bucket is a new
//     instance (its stream's creation time changed) and from then on
//     acquires nothing for TTL − SafetyMargin: the lost bucket's holders
//     stop within that time of their last renewal, which came before the
//     loss, so no two holders overlap. Their renewals on the new bucket find
//     no key (revisions of the new bucket are all above theirs) and end as
//     lost. The watch is made again on the new bucket. No epoch is reset by
//     hand, and lanes resume about one TTL after the loss (measured with a
//     2 s TTL: 2.3–2.5 s from the delete to each lane's first commit). The
//     replay and status tools read revisions, which carry the base, so they
//     need no base of their own. A Store with NoCreate (a bucket made
//     beforehand, for users without the right to create streams) never
//     creates it again: its holders stop as above and the lanes wait until
//     the bucket is made again (kfn: `kfn migrate --nats`, which takes the
//     same floor).
//   - Leader of a replicated bucket lost (Replicas 3 on a NATS cluster, the
//     server leading the bucket's stream killed). The other replicas elect
//     a new leader after nats-server's election timeout (4–9 s); writes fail
//     until then, so holders stop at TTL − SafetyMargin as with NATS down,
//     and acquire again, with larger tokens, once the bucket answers. The
//     bucket and its revisions survive, so nothing else changes (measured
//     with a 2 s TTL: lanes stood still 4.3–7.0 s over 7 runs).
//   - Member unhealthy (Config.Healthy; for kfn a worker that cannot reach
//     Postgres). It steps out as described in "Health": its items move
//     within about RenewEvery/4 of the hook reporting an error (measured
//     60 ms with RenewEvery 300 ms), not after TTL, and come back as fast.
//   - Network partition of one worker. For the cut-off worker this looks
//     like NATS down: it stops at TTL − SafetyMargin. For the others it
//     looks like a crash: they take over after TTL. If the worker can still
//     reach Postgres, the margin, and then the token, keep it from
//     committing after the takeover.
//   - Clean shutdown or rebalance. Run deletes its heartbeat, so the others
//     reassign at once (on shutdown, first thing, and once more after its
//     last heartbeat write has returned). Each moved claim finishes its
//     batch under a lease that is still being renewed, and then releases
//     it. The new owner acquires it within milliseconds (about 10–20 ms
//     measured). It acquires every lease it is now the target of at once,
//     each in its own goroutine, and a freed lease with one write that
//     expects the delete marker the watch showed (Create on a deleted key
//     is three round trips); so a handoff costs about three round trips
//     however many items move, where one acquire after another cost five
//     per item (measured through a proxy holding each request 200 ms: 6
//     items in 0.61 s, against 6.1 s one by one). A listing of the members
//     that began before a departure (or a join) the watch has shown does
//     not undo it: it would hand the items back to the member that left,
//     and they would be taken again once the next listing dropped it (a
//     clean stop's handoff measured at 1.36 s instead of about 0.1 s).
//     Run logs the phases of its stop at Info ("lease manager stopped":
//     left_after, work_returned_after, released_after, timed from the end
//     of its ctx).
//   - Seize (replay). The replay CLI's Put starts a new term with a larger
//     token, which it writes to Postgres, and so fences the current owner.
//     That owner's next renewal finds another term and its claim is lost.
//     The target member retries its Create until the CLI releases the
//     lease.
//
// # Assignment
//
// TargetOwner is plain rendezvous hashing: the member with the highest
// xxhash64(member, item) wins, and a change of one member among N moves
// about 1/N of the items. With few items per member it is as lumpy as
// chance: 12 items over 3 members leave one member with 7 or more, or with
// 1 or fewer, for about a quarter of member names. The Manager therefore
// uses Assign. Assign is the same preference order with a load bound of
// ceil(items/members), resolved as a stable matching. It moves about 1.1–1.2
// times the minimum when a member comes or goes.
//
// # Defaults
//
// TTL 5 s, RenewEvery 1 s, SafetyMargin 1.5 s, PollItemsEvery 3 s. A holder
// gets three renewal attempts, plus retries every 0.5 s after a failure,
// before it stops 3.5 s after its last successful renewal. Nobody can take
// the lease before 5 s. The 1.5 s between those two moments covers a late
// timer, the work noticing its ctx, and clock drift, with a wide margin.
// Expiry granularity (0.04–0.35 s late, measured) adds to the failover time
// but not to the risk. TTL must be at least 1 s (MinTTL), because the
// expiry timer fires at most every 250 ms and expiry markers need 1 s.
package lease
