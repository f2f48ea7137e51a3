package runtime

// This page is the worker's side of the lease and fencing design; the lease
// side (bucket layout, renewal, the timing margin measured on nats-server)
// is in package lease's documentation.
//
// # Ownership of a lane
//
// A lane is a Kafka partition of a function's topic, or the single lane of a
// NATS-triggered function's subject. Each lane has one lease in the NATS KV
// bucket kfn_leases, in the group "<function>/<topic or subject>". The
// workers of a function heartbeat as members of that group, and the target
// owner of each lane is chosen over the live members by rendezvous hashing
// capped at ceil(lanes/members), so a membership change moves about 1/N of
// the lanes. The lease revision that starts a term is its fencing token T.
//
// The states of a lane inside one worker:
//
//	leased ──claim in Postgres (epoch := T if T > epoch)──► owned ──batch──► owned …
//	  │               │ T ≤ epoch: a newer owner exists           │
//	  │               ▼                                            ├─ ctx cancelled (lease lost, rebalance,
//	  │            dropped (logged at warn with both epochs)       │  shutdown): finish or roll back the
//	  │                                                            │  in-flight batch, return, lease released
//	  └────────────────────────────────────────────────────────────┴─ commit fenced (epoch ≠ T): roll back,
//	                                                                   drop the lane
//
// # The fence is in the transaction
//
// Every batch transaction starts with
//
//	UPDATE kfn.cursors SET next_offset = $to … WHERE … AND epoch = $T AND next_offset = $from
//
// and rolls back when it changes no row. The same transaction claims the
// records in the inbox, runs the handler and writes the outbox rows, so the
// business write commits if and only if the owner was still the owner at
// commit time: Postgres row locks serialise the cursor update with the new
// owner's claim. A worker paused for longer than the lease (a zombie) cannot
// commit after it wakes up, whatever its clock says. That is what the Flink
// TaskManager in the introduction lacked: its old job kept writing because
// nothing at the sink compared ownership terms.
//
// # Timing
//
// Defaults: lease TTL 5 s, renewal every 1 s, safety margin 30% of the TTL.
// A holder stops using a lane 0.7 × TTL after its last successful renewal
// was sent, before the server can expire the lease; a successor acquires it
// after TTL (plus up to 0.35 s of server expiry lag). So a crashed worker's
// lanes move in TTL + about 1 s, against 45 s for Kafka's default session
// timeout. A clean shutdown or a rebalance moves a lane in milliseconds: the
// old owner finishes its batch and deletes the lease.
//
// # Failures and what they do to records
//
//   - Worker crash (SIGKILL) between the Postgres commit and the Kafka offset
//     mirror: nothing is lost or repeated. The next owner resumes at the
//     Postgres cursor; the Kafka group offset is only for lag tools.
//   - Worker crash inside a batch: the transaction never commits; the next
//     owner reads the same records again and applies them once.
//   - Zombie (SIGSTOP, GC pause, a VM suspended): its lease expires and a new
//     owner writes a larger epoch. On waking, its next commit's cursor update
//     matches no row and rolls back; its lease renewal fails and the lane is
//     dropped.
//   - NATS down: renewals fail, every worker stops its lanes 0.7 × TTL after
//     its last renewal, and processing pauses. Nothing commits without a
//     lease, so nothing is duplicated. When NATS returns, leases are
//     acquired again with larger tokens and processing resumes.
//   - Postgres down: batches fail and are retried with capped exponential
//     backoff, forever; a handler's attempt budget is not spent on outages.
//   - Kafka down: reads retry; nothing is committed without records.
//   - Replay: `kfn replay` seizes the lease (a larger token), writes it to
//     Postgres, moves the cursor and releases the lease; the owner's next
//     commit is fenced and a worker takes the lane again at the new cursor.
//   - NATS state lost (a wiped bucket restarts revisions at 1): Postgres
//     refuses the smaller tokens and lanes stay unowned, the safe failure. An
//     operator resets kfn.cursors.epoch to 0 for them after checking that no
//     old worker runs.
