package runtime_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/devstack"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/operator/verify"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// The key-lane fault tests: effects-worker processes run each partition as
// 16 key-lanes (KFN_KEY_CONCURRENCY=16) over a topic of 2 partitions whose
// records are spread over 64 keys each, with a per-key sequence number in
// every value. They end with production stopped, the cursors at the high
// watermarks and the checker's counts at zero: nothing lost, nothing
// applied twice, and per key, in commit order, the sequence numbers in
// order (effects.KeyOrder), every effect committed under the token of its
// partition's owner at the time, by a transaction that held its key-lane's
// fence.
const (
	keyLanePartitions = 2
	keyLaneCount      = 16
	keyLaneKeys       = 64
)

func newKeyLaneCluster(t *testing.T) *cluster {
	t.Helper()
	c := newClusterWith(t, kfntest.Kafka(t), keyLanePartitions)
	c.keyLanes, c.keys = keyLaneCount, keyLaneKeys
	return c
}

// An owner is SIGKILLed while one of its key-lanes is inside a transaction
// past its fence (frozen there, then killed), five times, and restarted
// under a new id. Its other key-lanes have committed records above the
// cursor, which waits on the uncommitted prefix: the next owner resumes at
// the cursor, skips what the inbox holds above it, and applies the rest.
// Each time, how long the victim's partition stood still (from the kill to
// the new owner's first cursor move there) is measured against the lease
// TTL.
func TestKeyLanesKillOwnerMidCommit(t *testing.T) {
	c := newKeyLaneCluster(t)
	workers, prod := c.startLoad(2)

	const kills = 5
	const stallBound = 5 * failoverTTL
	var stalls []time.Duration
	for i := range kills {
		time.Sleep(randomDuration(300*time.Millisecond, 1500*time.Millisecond))
		requireAlive(t, workers...)
		kill := c.killAndReplace(workers, "kfn.key_lanes", stallBound+10*time.Second)
		stalls = append(stalls, kill.stoodStill)
		t.Logf("kill %d: SIGKILL %s inside a key-lane's fenced transaction (partitions %v); a new owner moved the cursor %s later",
			i+1, kill.victim, kill.partitions, kill.stoodStill.Round(time.Millisecond))
	}
	slices.Sort(stalls)
	line := fmt.Sprintf("key-lanes (%d per partition): partition stood still after a SIGKILL mid-commit: median %s, max %s over %d kills (lease TTL %s, renew %s)",
		keyLaneCount, stalls[len(stalls)/2].Round(time.Millisecond), stalls[len(stalls)-1].Round(time.Millisecond), len(stalls), failoverTTL, failoverRenew)
	t.Log(line)
	fmt.Println(line)
	if worst := stalls[len(stalls)-1]; worst > stallBound {
		t.Errorf("a partition stood still %s after its owner was killed, over the liveness bound %s (5×TTL): %v", worst, stallBound, stalls)
	}
	// kfn verify under load: the key-lanes have committed records above
	// the cursors (pending, not violations), and every claim found the
	// older owners' key-lane commits ended.
	c.verify("under load")

	hw := c.finishLoad(prod, workers...)
	c.check(hw)
	c.verify("caught up")
}

// verify runs kfn verify over the function's effects (one row per applied
// record) and the event stream, and requires no violation.
func (c *cluster) verify(when string) {
	c.t.Helper()
	rep, err := verify.Run(context.Background(), c.pg.Pool, jetStream(c.t, c.natsURL), verify.Spec{
		Function: c.fn, Topic: c.topic, KafkaBrokers: c.kafka.Brokers, Examples: 5, UnpublishedAfter: time.Minute,
		EffectsSQL: `SELECT topic, partition, "offset" FROM ` + effects.Table(c.fn), Stream: runtime.DefaultStream,
	})
	if err != nil {
		c.t.Fatalf("verify %s: %v", when, err)
	}
	c.t.Logf("verify %s: ok %v, %d records checked", when, rep.OK, rep.Checked.Records)
	if !rep.OK {
		c.t.Errorf("verify %s: violations %+v", when, rep.Violations)
	}
}

// An owner is frozen (SIGSTOP) past its lease TTL while one of its
// key-lanes is inside a transaction that has claimed records in the inbox
// (past its fence: the fence and the claim are one statement). The other
// worker must take its partition over and commit there while it sleeps:
// its claim ends the frozen sessions that hold key-lane rows. Woken up
// (SIGCONT), the zombie's key-lanes must not commit under the old token:
// each one's next transaction is refused by its key-lane row, or its lease
// watchdog stops the partition first; and it rejoins as a member. How long
// the partition stood still (from the freeze to the new owner's first
// cursor move) is measured against the lease TTL.
func TestKeyLanesZombieWakesAfterTakeover(t *testing.T) {
	c := newKeyLaneCluster(t)
	workers, prod := c.startLoad(2)

	z := c.freezeZombie(workers, "kfn.inbox", 1, "the other worker to take over the zombie's partition and move its cursor")
	stall := z.takeover
	line := fmt.Sprintf("key-lanes (%d per partition): a zombie's partition stood still %s from the freeze to the new owner's first cursor move (lease TTL %s, renew %s)",
		keyLaneCount, stall.Round(time.Millisecond), failoverTTL, failoverRenew)
	t.Log(line)
	fmt.Println(line)
	if stall > 5*failoverTTL {
		t.Errorf("the zombie's partition stood still %s, over the liveness bound %s (5×TTL)", stall, 5*failoverTTL)
	}
	// Records pile up on the zombie's old partition while it sleeps, for
	// its key-lanes to find when they wake.
	z.wake()
	hw := z.finish(workers, prod)
	c.check(hw)
}

// TestFenceRefusesWokenZombieOnKeyLane is TestFenceRefusesWokenZombieOnPartition
// for a key-lane: A runs its partition as 16 key-lanes, and the records
// all have one key, so one key-lane has them. It is frozen right before
// the fence of its first transaction, with A's lease, until B has claimed
// the partition; B is held at its own key-lane's fence until A has woken.
// A's key-lane row must refuse the fence under A's stale token, and every
// record be applied once, by B.
func TestFenceRefusesWokenZombieOnKeyLane(t *testing.T) {
	b := setup(t, 1)
	fn := effects.Function(b.fn, b.topic)
	fn.KeyConcurrency = keyLaneCount
	const n = 30
	msgs := make([]kafka.Message, n)
	for i := range msgs {
		msgs[i] = kafka.Message{Partition: 0, Key: []byte("k"), Value: effects.KeyedValue("k", i+1)}
	}
	b.kafka.Produce(t, b.topic, msgs...)
	produced := make([]effects.Produced, n)
	for i := range produced {
		produced[i] = effects.Produced{Partition: 0, Offset: int64(i)}
	}

	part := inbox.Partition{Consumer: b.fn, Topic: b.topic, Partition: 0}
	race := raceZombie(t, b, part, "the partition's key-lane", fn, fn)
	b.waitCaughtUp(t, b.fn)
	race.finish(t, n)
	if got, want := effectTokens(t, b), map[int64]int{race.tB: n}; !maps.Equal(got, want) {
		t.Errorf("effects by the epoch their transaction saw after its fence: %v, want %v (all under B's)", got, want)
	}
	b.check(t, b.fn, produced)
}

// The Postgres server is restarted (a fast shutdown, then a start) under
// load while both owners' key-lanes commit. Their transactions fail and
// are retried with backoff, the workers step out of their leases while
// Postgres does not answer and claim again once it does; nothing is lost
// or applied twice, and per key the order holds. How long the partitions
// stood still (from the restart to the first cursor move after it on every
// partition) is measured against the lease TTL.
func TestKeyLanesSurvivePostgresRestart(t *testing.T) {
	ctx := context.Background()
	srv, err := devstack.StartPostgres(ctx, devstack.PostgresOptions{})
	if err != nil {
		t.Fatalf("start a Postgres server of the test's own: %v", err)
	}
	t.Cleanup(func() { _ = srv.Stop() })
	cfg, err := pgxpool.ParseConfig(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := schema.Migrate(ctx, pool); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	c := newKeyLaneCluster(t)
	c.pg = &kfntest.PG{Pool: pool, URL: srv.URL}
	workers, prod := c.startLoad(2)

	before := c.cursors()
	restarted := time.Now()
	if err := srv.Restart(ctx); err != nil {
		t.Fatalf("restart Postgres: %v", err)
	}
	down := time.Since(restarted)
	var stall time.Duration
	waitUntil(t, 60*time.Second, "every partition's cursor to move after the restart", func() (bool, string) {
		curs, err := c.readCursors()
		if err != nil {
			return false, err.Error()
		}
		for p, old := range before {
			if cur := curs[p]; cur.next <= old.next {
				return false, fmt.Sprintf("partition %d at %d (before the restart: %d)", p, cur.next, old.next)
			}
		}
		stall = time.Since(restarted)
		return true, ""
	})
	line := fmt.Sprintf("key-lanes (%d per partition): Postgres restarted (down %s): every partition's cursor moved again %s after the restart began (lease TTL %s, renew %s)",
		keyLaneCount, down.Round(time.Millisecond), stall.Round(time.Millisecond), failoverTTL, failoverRenew)
	t.Log(line)
	fmt.Println(line)
	if stall > down+5*failoverTTL {
		t.Errorf("the partitions stood still %s after Postgres came back, over the liveness bound %s (5×TTL)", stall-down, 5*failoverTTL)
	}
	c.waitBalanced(ids(workers), 30*time.Second)
	requireAlive(t, workers...)

	hw := c.finishLoad(prod, workers...)
	c.check(hw)
	c.verify("after the restart")
}

// TestNATSTriggeredFunctionWithKeyLanesKeepsKeyOrder runs a NATS-triggered
// function with 16 key-lanes over events of 10 keys, each stored twice in
// the stream (published again past its duplicate window): every event is
// applied once, each key's events in stream order (by a per-key sequence
// number in the value, against the order of the effects' commits), and
// every event is acked.
func TestNATSTriggeredFunctionWithKeyLanesKeepsKeyOrder(t *testing.T) {
	b := setup(t, 1)
	ctx := context.Background()
	js := jetStream(t, b.cfg.NATSURL)
	stream, subject := kfntest.Name(t, "stream"), kfntest.Name(t, "subj")+".created"
	const window = 200 * time.Millisecond
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}, Duplicates: window}); err != nil {
		t.Fatal(err)
	}
	const events, keys = 300, 10
	for round := 0; round < 2; round++ {
		for i := range events {
			key := fmt.Sprintf("k%d", i%keys)
			msg := nats.NewMsg(subject)
			msg.Header.Set("Nats-Msg-Id", fmt.Sprintf("ev-%03d", i))
			msg.Header.Set("kfn-key", key)
			msg.Data = effects.KeyedValue(key, i/keys+1)
			if _, err := js.PublishMsg(ctx, msg); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(2 * window) // past the window: the second round is stored again
	}

	table := pgx.Identifier{"events_" + b.fn}.Sanitize()
	fn := runtime.Function{
		Name: b.fn, Subject: subject, Stream: stream, KeyConcurrency: keyLaneCount,
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` (id bigserial, event_id text, value text, lsn pg_lsn DEFAULT pg_current_wal_insert_lsn())`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, _ *runtime.Events) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` (event_id, value) VALUES ($1, $2)`, rec.EventID, string(rec.Value))
			return err
		},
	}
	w, stop := b.run(t, fn)
	b.waitEventsDone(t, js, stream, events, 60*time.Second)
	stop()
	wantDuplicates(t, w, events, "the inbox skips the second copy of each event")

	rows, err := b.pg.Pool.Query(ctx, `SELECT event_id, value FROM `+table+` ORDER BY lsn, id`)
	if err != nil {
		t.Fatal(err)
	}
	seen, last := map[string]int{}, map[string]int{}
	var id, value string
	_, err = pgx.ForEachRow(rows, []any{&id, &value}, func() error {
		seen[id]++
		key, n, _ := strings.Cut(value, "#")
		seq, _ := strconv.Atoi(n)
		if seq <= last[key] {
			t.Errorf("key %s: event %s (#%d) committed after #%d", key, id, seq, last[key])
		}
		last[key] = seq
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range events {
		if n := seen[fmt.Sprintf("ev-%03d", i)]; n != 1 {
			t.Errorf("event ev-%03d applied %d times, want once", i, n)
		}
	}
	var keyLaneRows int
	if err := b.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.key_lanes WHERE consumer = $1 AND next_offset > 0`, b.fn).Scan(&keyLaneRows); err != nil || keyLaneRows < 2 {
		t.Errorf("%d key-lanes committed (%v); the events' 10 keys should spread over several of the 16", keyLaneRows, err)
	}
}

// TestKeyLanesApplyEveryRecordOnceInKeyOrder runs one worker with 16
// key-lanes per partition (in this process, so the race detector sees the
// key-lanes, the dispatcher and the cursor mover) over 2 partitions of
// records of 40 keys each, with KeyOrder ParkKey: one key's second record
// fails permanently, which parks that key's later record behind it and
// nothing else. Every other record is applied once, each key's in order,
// and the cursors reach the end.
func TestKeyLanesApplyEveryRecordOnceInKeyOrder(t *testing.T) {
	b := setup(t, 2)
	fn := effects.Function(b.fn, b.topic)
	fn.KeyConcurrency, fn.KeyOrder = keyLaneCount, runtime.ParkKey
	const perPartition, keys = 600, 40
	var produced, dead []effects.Produced
	for p := range 2 {
		msgs := make([]kafka.Message, perPartition)
		for i := range msgs {
			key := fmt.Sprintf("k%d-%d", p, i%keys)
			msgs[i] = kafka.Message{Partition: p, Key: []byte(key), Value: effects.KeyedValue(key, i/keys+1)}
			rec := effects.Produced{Partition: int32(p), Offset: int64(i)}
			if p == 0 && i%keys == 7 && i/keys >= 1 { // key k0-7: its 2nd record fails, and parks its later ones
				if i/keys == 1 {
					msgs[i].Value = []byte(effects.Permanent)
				}
				dead = append(dead, rec)
			}
			produced = append(produced, rec)
		}
		b.kafka.Produce(t, b.topic, msgs...)
	}
	w, stop := b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	awaitApplied(w, int64(len(produced)-len(dead)))
	stop()
	rep, err := effects.Check(context.Background(), b.pg.Pool, b.fn, b.topic, produced, effects.KeyOrder())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("checker: %s", rep)
	if v := rep.Violations(dead...); len(v) > 0 {
		t.Errorf("exactly-once or key order violated: %s", strings.Join(v, "; "))
	}
	if got := w.Stats().KeyParked.Load(); got != int64(len(dead)-1) {
		t.Errorf("%d records parked, want %d: the failed key's later records, and no other key's", got, len(dead)-1)
	}
}

// TestKeyLanesReplayIsIdempotentAndReexecutionApplies runs 16 key-lanes
// through kfn replay while the worker runs: an idempotent replay from
// offset 0 (the replay's claim fences the key-lanes; the worker takes the
// partition again) applies nothing twice, and a re-execution of [100, 200)
// applies exactly those once more, each key's in order; kfn verify
// accepts both.
func TestKeyLanesReplayIsIdempotentAndReexecutionApplies(t *testing.T) {
	b := setup(t, 1)
	ctx := context.Background()
	fn := effects.Function(b.fn, b.topic)
	fn.KeyConcurrency = keyLaneCount
	const n, keys = 400, 20
	msgs := make([]kafka.Message, n)
	for i := range msgs {
		key := fmt.Sprintf("k%d", i%keys)
		msgs[i] = kafka.Message{Partition: 0, Key: []byte(key), Value: effects.KeyedValue(key, i/keys+1)}
	}
	b.kafka.Produce(t, b.topic, msgs...)
	_, stop := b.run(t, fn)
	defer stop()
	b.waitCaughtUp(t, b.fn)
	effectsPer := func() map[int]int { // effects per offset count → how many offsets have it
		rows, err := b.pg.Pool.Query(ctx, `SELECT count(*) FROM `+effects.Table(b.fn)+` GROUP BY "offset"`)
		if err != nil {
			t.Fatal(err)
		}
		out := map[int]int{}
		var c int
		if _, err := pgx.ForEachRow(rows, []any{&c}, func() error { out[c]++; return nil }); err != nil {
			t.Fatal(err)
		}
		return out
	}
	replay := func(opts inbox.ReplayOptions, from int64) {
		t.Helper()
		opts.Actor, opts.Reason = "test", "key-lanes"
		if _, err := operator.Replay(ctx, b.pg.Pool, jetStream(t, b.cfg.NATSURL), operator.ReplaySpec{
			Function: b.fn, Topic: b.topic, Partitions: []int32{0}, From: from, LeaseBucket: b.cfg.LeaseBucket, ReplayOptions: opts,
		}); err != nil {
			t.Fatalf("replay %+v from %d: %v", opts, from, err)
		}
	}

	replay(inbox.ReplayOptions{}, 0)
	b.waitCaughtUp(t, b.fn)
	time.Sleep(500 * time.Millisecond) // a record applied again would show by now
	if got := effectsPer(); !maps.Equal(got, map[int]int{1: n}) {
		t.Errorf("after an idempotent replay from 0: offsets by effect count %v, want all %d once", got, n)
	}

	replay(inbox.ReplayOptions{To: 200, Reexecute: true}, 100)
	waitFor(t, 30*time.Second, "the re-executed records applied again", func() bool {
		return maps.Equal(effectsPer(), map[int]int{1: n - 100, 2: 100})
	})
	b.waitCaughtUp(t, b.fn)
	rows, err := b.pg.Pool.Query(ctx, `SELECT convert_from(value, 'UTF8') FROM `+effects.Table(b.fn)+` WHERE "offset" BETWEEN 100 AND 199 ORDER BY lsn, id`)
	if err != nil {
		t.Fatal(err)
	}
	// Every key's effects in commit order: its first apply in order, then
	// its re-executed records in order again.
	seqs := map[string][]int{}
	var v string
	if _, err := pgx.ForEachRow(rows, []any{&v}, func() error {
		key, num, _ := strings.Cut(v, "#")
		s, _ := strconv.Atoi(num)
		seqs[key] = append(seqs[key], s)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	for key, s := range seqs {
		half := len(s) / 2
		if len(s) != 10 || !slices.IsSorted(s[:half]) || !slices.IsSorted(s[half:]) || !slices.Equal(s[:half], s[half:]) {
			t.Errorf("key %s: sequence numbers of offsets 100–199 in commit order %v; want its 5 records in order, then again in order", key, s)
		}
	}
	rep, err := verify.Run(ctx, b.pg.Pool, nil, verify.Spec{Function: b.fn, Topic: b.topic, KafkaBrokers: b.kafka.Brokers, Examples: 5, UnpublishedAfter: time.Hour,
		EffectsSQL: `SELECT topic, partition, "offset" FROM ` + effects.Table(b.fn)})
	if err != nil || !rep.OK {
		t.Errorf("verify after the replays: %v, violations %+v", err, rep)
	}
}

// A worker refuses, at start, a Postgres pool too small for its key-lanes
// (pool_max_conns in the database URL below K + 2: they would wait for
// connections, silently slower than one lane), and a key-lane count out
// of range, naming the setting.
func TestKeyLanesRefuseAPoolTooSmallAndABadCount(t *testing.T) {
	b := setup(t, 1)
	fn := effects.Function(b.fn, b.topic)
	fn.KeyConcurrency = keyLaneCount
	cfg := b.cfg
	sep := "?"
	if strings.Contains(cfg.DatabaseURL, "?") {
		sep = "&"
	}
	cfg.DatabaseURL += sep + "pool_max_conns=8"
	_, err := worker.New(context.Background(), cfg, fn)
	want := "pool_max_conns=8 is too small for 16 key-lanes per partition"
	if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "--database-url") {
		t.Errorf("worker.New with pool_max_conns=8 and 16 key-lanes = %v; want an error naming --database-url that says %q", err, want)
	}
	cfg = b.cfg
	cfg.KeyConcurrency = 1000
	if _, err := worker.New(context.Background(), cfg, fn); err == nil || !strings.Contains(err.Error(), "--key-concurrency (KFN_KEY_CONCURRENCY)") {
		t.Errorf("worker.New with --key-concurrency 1000 = %v; want an error naming --key-concurrency", err)
	}
	fn.KeyConcurrency = -1
	if _, err := worker.New(context.Background(), b.cfg, fn); err == nil || !strings.Contains(err.Error(), "KeyConcurrency -1 is out of range") {
		t.Errorf("worker.New with a function's KeyConcurrency -1 = %v; want it refused", err)
	}
}

// TestKeyLanesHoldNoMoreBytesThanABatch: 16 key-lanes hold at most
// --batch-max-bytes of records (plus one), as one lane's batch does, so
// their parallelism does not multiply a partition's memory. With 1 KiB
// records and a 4 KiB bound, at most 5 handler calls run at once over
// all key-lanes; more than one still do.
func TestKeyLanesHoldNoMoreBytesThanABatch(t *testing.T) {
	b := setup(t, 1)
	b.cfg.BatchMaxBytes = 4 << 10
	b.cfg.NoRelay = true
	fn := effects.Function(b.fn, b.topic)
	fn.KeyConcurrency = keyLaneCount
	var running, most atomic.Int32
	apply := fn.Handler
	fn.Handler = func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
		now := running.Add(1)
		defer running.Add(-1)
		for m := most.Load(); now > m && !most.CompareAndSwap(m, now); m = most.Load() {
		}
		time.Sleep(20 * time.Millisecond) // long enough for the key-lanes to overlap
		return apply(ctx, tx, rec, out)
	}
	const n, keys, size = 160, 32, 1 << 10
	msgs := make([]kafka.Message, n)
	produced := make([]effects.Produced, n)
	for i := range msgs {
		key := fmt.Sprintf("k%d", i%keys)
		value := effects.KeyedValue(key, i/keys+1)
		msgs[i] = kafka.Message{Partition: 0, Key: []byte(key), Value: value, Headers: []kafka.Header{{Key: "pad", Value: make([]byte, size-len(key)-len(value)-len("pad"))}}}
		produced[i] = effects.Produced{Partition: 0, Offset: int64(i)}
	}
	b.kafka.Produce(t, b.topic, msgs...)
	_, stop := b.run(t, fn)
	b.waitCaughtUp(t, b.fn)
	stop()
	bound := int32(b.cfg.BatchMaxBytes/size + 1)
	t.Logf("at most %d handler calls ran at once over %d key-lanes (records of %d bytes, --batch-max-bytes %d: bound %d)", most.Load(), keyLaneCount, size, b.cfg.BatchMaxBytes, bound)
	if m := most.Load(); m > bound || m < 2 {
		t.Errorf("%d handler calls ran at once, want 2 to %d: the key-lanes must run side by side within --batch-max-bytes", m, bound)
	}
	rep, err := effects.Check(context.Background(), b.pg.Pool, b.fn, b.topic, produced, effects.KeyOrder())
	if err != nil {
		t.Fatal(err)
	}
	if v := rep.Violations(); len(v) > 0 {
		t.Errorf("exactly-once or key order violated: %s", strings.Join(v, "; "))
	}
}
