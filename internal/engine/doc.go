// Package engine is kfn's worker engine, behind the author's API: the
// author's types are package runtime's, and package runtime/worker starts
// the engine (through internal/process for a function binary). It owns a
// worker's lanes (Kafka partitions and JetStream subjects) through fenced
// NATS leases, reads records in batches and applies each batch in one
// Postgres transaction together with the inbox claim, the fenced cursor
// move and the outbox rows the handler emitted; it runs the dead-letter
// retries, inbox retention and the outbox relay's shards. The files are
// named after the type whose methods they hold: worker*.go (the worker:
// connections, leases, lanes, readiness, retries, retention, memory, metrics and
// the relay), partition_run.go and subject_run.go (one lane each),
// applier*.go (one batch transaction: the handler call, parked keys, spans,
// the claim and the commit), tracker*.go (fencing and the inbox),
// retry_lane.go (dead letters marked for retry), relay_process.go (kfn
// relay) and startup.go (the phases of a worker's start, logged with its
// first commit). Its dependencies are explicit: runtime (the author's types),
// internal/preflight (configuration checks, the role's rights, Setup),
// internal/observe (counters, metrics, Postgres health, span helpers),
// internal/kafkasource (partitions, the read_committed reader, the
// consumer-group mirror), inbox (cursors, fencing, dead letters), outbox
// (rows, event identity, the relay), internal/lease (leases and their
// timing), internal/naming (the lease, consumer and event names it shares
// with the operator tools), internal/settings (configuration) and
// internal/connect (connections). It is not a stable API.
//
// The rest of this page is the worker's side of the lease and fencing
// design; the lease side (bucket layout, renewal, the timing margin measured
// on nats-server) is in package lease's documentation.
//
// # Ownership of a lane
//
// A lane is a Kafka partition of a function's topic, or one of the Lanes
// lanes of a NATS-triggered function's subject, which split its events by
// key hash (subject_run.go; the count is kept by inbox.ClaimLane). Each lane
// has one lease in the NATS KV
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
// commit after it wakes up, whatever its clock says. That is what a Flink
// TaskManager lacked when it kept running its old job after a JobManager
// failover: the old job kept writing because nothing at the sink compared
// ownership terms.
//
// A batch's $to is past its last record and past the transaction markers
// and aborted records that follow it in the same fetch. When a fetch holds
// nothing but those (a producer's last transaction aborted, or its marker
// came alone), the lane waits BatchWait for a record to carry the cursor
// past them, and otherwise moves the cursor there in a transaction of its
// own: the same fenced UPDATE, with no inbox claim. So a partition written
// by transactional producers drains to its log end (lag 0), and a zombie
// cannot move its cursor either.
//
// # Key-lanes
//
// A function with KeyConcurrency K > 1 runs each partition it owns as K
// key-lanes (partition_keylanes.go, tracker_keylane.go). The partition's
// reader dispatches each record, in offset order, to the key-lane of its
// key (keyLaneOf: a hash of the key's bytes; a record with no key goes to
// key-lane 0, so that those keep their order among themselves). A key-lane applies its records in
// offset order through an applier of its own, in transactions that begin
//
//	UPDATE kfn.key_lanes SET next_offset = … WHERE … AND lane = $k AND epoch = $T
//
// in the statement that claims its offsets in the inbox (ON CONFLICT DO
// NOTHING: other key-lanes claim the offsets between), then run the
// handler and write the outbox rows: a batch transaction, fenced by the
// key-lane's row instead of the cursor row, so the K key-lanes never wait
// for each other. A claim of the partition, a replay's too, writes its
// epoch into the key-lane rows in its own transaction (the trigger
// kfn.fence_key_lanes on the cursor row's epoch; the new owner's claim
// also writes its own rows): that UPDATE waits for every key-lane
// transaction in flight, which commits before the claim or is fenced
// after it, and a frozen one is ended like a frozen batch (inbox.TakeOver
// ends the sessions that hold the partition's key-lane rows too).
//
// The cursor moves only over the prefix of dispatched offsets that every
// key-lane has committed: the cursor mover, one goroutine per partition,
// moves it there in small transactions of its own, fenced as a pass over
// offsets without records (inbox.Advance under T, no inbox row). At most K
// × --batch-size records are dispatched and not yet under the cursor. A
// move over offsets without committed records (transaction markers), a new
// reader after a Kafka outage, dead letter retries and a batch whose gap
// may be an expiry wait until the key-lanes have drained, and then run as
// for one lane.
//
// Why the cursor plus the inbox rows above it is still permanent dedup.
// Offsets below the high-water mark were handled: the cursor passed them,
// and it passes an offset only once its key-lane committed it (applied or
// dead-lettered). Offsets at or above the high-water mark are handled if
// and only if the inbox holds a row for them: a key-lane claims an offset
// in the transaction that applies it, and retention deletes inbox rows
// only below the high-water mark (inbox.Purge), which never moves back.
// So after a crash the next owner resumes at the cursor, skips what is
// below the high-water mark without asking, and finds in the inbox every
// offset above it that the old owner's key-lanes committed, whose rows no
// purge can have removed; an offset is applied again only if no
// transaction that claimed it ever committed. The same holds for a zombie:
// its key-lanes' transactions after the claim are fenced, and those before
// it left inbox rows that the new owner's claims skip.
//
// A NATS-triggered function's lane (subject_keylanes.go) applies each
// batch it fetched over its key-lanes, side by side, each transaction
// fenced by its key-lane's row and claimed in the event inbox; it moves
// its cursor (a progress marker) past the batch in a small fenced
// transaction once every key-lane has committed, and then acks the batch.
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
// # Postgres round trips, handler calls and the lease
//
// A lease stays valid 0.7 × TTL after its last renewal (the validity
// window: 3.5 s by default). Nothing that a worker waits for in Postgres may
// hold a lane longer than that once another worker could take it:
//
//   - Every Postgres round trip of a worker (a statement, BEGIN, COMMIT, a
//     COPY, a connect) has a deadline of 5/4 × --statement-timeout; the
//     sessions run with statement_timeout = --statement-timeout. A slow
//     statement is cancelled by the server first and fails as itself (in a
//     handler: the record's timeout, dead-lettered without another attempt).
//     A round trip
//     still unanswered at the deadline means a frozen or dead connection:
//     pgx closes it and the lane retries on another. Rule: 5/4 ×
//     --statement-timeout ≤ 0.7 × --lease-ttl (defaults: 2 s, 2.5 s, 3.5 s).
//   - A handler call is bounded by --handler-timeout, which may be longer
//     than the TTL: while a handler runs Go code the worker keeps renewing
//     (it is healthy), and each statement it runs is bounded as above. A
//     handler that overruns it is a timeout, dead-lettered with reason
//     timeout without another attempt (another would hold the lane for
//     another whole timeout). A handler that ignores its ctx is abandoned 1 s
//     after its deadline: kfn ends its transaction's session
//     (pg_terminate_backend, so Postgres rolls it back and releases its
//     locks, whatever statement it is in), closes its socket, takes the
//     connection out of the pool, dead-letters the record in a new
//     transaction and goes on; the handler's goroutine, which Go cannot stop,
//     is counted in kfn_handlers_abandoned_running until it returns. The lane
//     stands still for --handler-timeout plus about 1 s. Rule:
//     --handler-timeout ≥ 5/4 × --statement-timeout, or the handler's own
//     deadline would close the connection before the server cancels a slow
//     statement, which would then look like an infrastructure failure,
//     retried forever, instead of the record's error. Unless it is set,
//     --statement-timeout is 0.4 × --lease-ttl or 0.8 × --handler-timeout,
//     whichever is less, so the defaults always agree; a worker refuses
//     settings that break a rule and names the flags to change.
//   - Why not a deadline on the whole batch transaction: a batch runs up to
//     --batch-size handler calls, so a deadline short enough to catch a
//     frozen connection within the validity window would cut legitimate
//     batches of slow handlers, and retry them forever. A deadline on each
//     round trip catches a frozen connection as soon, whatever the batch.
//   - The server ends a session idle inside a transaction for longer than
//     --handler-timeout plus one round trip
//     (idle_in_transaction_session_timeout), which no live worker does, so a
//     frozen or vanished worker's transaction does not keep its locks. PostgreSQL 15 has no
//     transaction_timeout; this and statement_timeout bound a transaction's
//     every wait instead. A new owner's claim ends such a session at once
//     when it holds the cursor row (inbox.TakeOver), so the takeover never
//     waits for these timeouts, provided the new owner's role may signal
//     the older session (the same role, or pg_signal_backend for a role
//     that is not a superuser); otherwise its claim is refused and retried
//     until the older session ends: the worker says so once (WARN) and
//     counts each refusal in kfn_fence_terminate_denied_total.
//   - Connections use TCP keepalive on both ends (idle --lease-ttl, interval
//     --lease-renew, 3 probes), so a vanished peer is noticed without the
//     kernel's defaults of hours. The server-side settings are sent as
//     connection startup parameters; settings in the database URL win over
//     them (behind PgBouncer, list them in its ignore_startup_parameters).
//   - Health: a probe on a connection of its own asks the server every
//     --lease-renew, with a timeout of --lease-renew, and every successful
//     round trip of the pool counts as an answer too. Once Postgres has not
//     answered for 0.7 × TTL − --lease-renew since the first unanswered
//     probe, the worker is unhealthy: it releases every lease and leaves its
//     lease groups (lease.Config.Healthy), so the workers that reach Postgres
//     take its lanes and relay shards over within milliseconds, and it takes
//     none until a probe succeeds again. A lane that cannot reach Postgres
//     is thus given up within the validity window of losing it, while NATS
//     still answers (measured with a 2 s TTL and a frozen proxy: 1.2–1.9 s
//     from the freeze to the new owner's first commit). A worker paused
//     (SIGSTOP) is not unhealthy on waking: only an unanswered probe makes it
//     so.
//
// # The Kafka consumer group mirror
//
// Every second the cursors committed since the last flush are committed as
// the offsets of the function's consumer group (--consumer-group, default
// the function's name), with generation -1, no member and the metadata
// "kfn-mirror": lag tools and KEDA read them, kfn never does. Before its
// first commit to a group a worker checks that the group is not another
// consumer's: it has no members (kfn never joins a group) and no offset
// without kfn's metadata. Otherwise nothing is written to it; a WARN names
// --consumer-group, and the group is looked at again every minute. A failed
// commit is retried at the next flush and logged at WARN at most every 30 s
// per group and topic, with the count of failures held back.
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
//     backoff; a handler's attempt budget is not spent on outages. Within
//     the validity window every worker that cannot reach it steps out of its
//     leases, so if some worker still reaches Postgres it takes the lanes
//     over, and if none does, nobody claims and no epoch changes until
//     Postgres answers again.
//   - A frozen path to Postgres (sockets open, nothing answered) for one
//     worker: its round trips time out and its probe goes unanswered, so it
//     steps out as above while it still renews nothing; the new owners'
//     claims end its sessions that hold cursor rows. When the path thaws,
//     whatever it sent is refused by the fence, and it rejoins.
//   - Kafka down: each lane waits with capped backoff (100 ms to 1 s) and
//     reads again from its cursor with a new reader; it keeps its lease and
//     epoch (the worker is healthy, and another owner could not read
//     either), and its lag stays exported with its last value. Reading
//     resumes within about a second of the broker's return (measured after
//     a 30 s outage: 0.05–1.4 s per lane). Nothing is committed without
//     records.
//   - Replay: `kfn replay` seizes the lease (a larger token), writes it to
//     Postgres, moves the cursor and releases the lease; the owner's next
//     commit is fenced and a worker takes the lane again at the new cursor.
//   - Dead letter retry: `kfn dlq retry` only marks letters. The lane that
//     owns a letter's partition (or subject) applies it between two batches,
//     in a transaction fenced like a batch (inbox.FenceLane writes the
//     cursor row under the lane's token without moving it) that deletes the
//     letter only while it is still marked, before it runs the handler: a
//     zombie's retry is refused by the fence, and a letter is applied once
//     however often it is retried (retry_lane.go).
//   - Parked keys (KeyOrder ParkKey): a dead-lettered record blocks its key
//     on its partition in the dead letter's transaction (kfn.parked_keys,
//     written under the lane's fence), and the key's later records are
//     dead-lettered as key_parked without reaching the handler. Retrying
//     the blocker successfully, or discarding or purging it, releases the
//     key in that transaction and marks its parked letters for retry; the
//     lane applies them in offset order before any later record of the key
//     reaches the handler, and one that fails blocks the key again
//     (applier_parkkey.go has the ordering argument).
//   - NATS state lost (the lease bucket deleted or wiped): the workers
//     create it again by themselves, its tokens starting above the largest
//     epoch in kfn.cursors and the largest revision they saw (package lease,
//     "Bucket lost"), wait until the lost leases have run out, and claim
//     again with those larger tokens. No epoch is reset by hand; lanes
//     resume about one TTL after the loss (measured with a 2 s TTL: 2.3–2.5 s).
package engine
