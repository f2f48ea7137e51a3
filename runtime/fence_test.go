package runtime_test

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/internal/faults"
	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// These tests freeze a worker A's lane inside a batch transaction, and its
// lease with it, as a SIGSTOP, a long GC pause or a suspended VM would,
// until the lease has expired and a worker B has claimed the lane; then
// they wake A. In a real wake-up A's lease watchdog usually stops the lane
// before its next statement, so the fence in Postgres may never be what
// refuses the zombie; here A's next statement is its fence, run under its
// stale token, and Postgres alone must refuse it.
//
// Both workers run in this process. The hooks of runtime/internal/faults
// hold a lane at a point of its fence and freeze a lease claim: no renewal,
// and no cancellation of its work (watchdog, lost renewal, rebalance) until
// the freeze ends. The workers are named so that the lane's lease item is
// B's when both are members: B's arrival moves the lane away from A, which
// cannot act on that while frozen, and B acquires the lease once A's has
// expired.

const (
	fenceTTL   = 2 * time.Second
	fenceRenew = 500 * time.Millisecond
	// fenceTakeover bounds how long a takeover of a frozen lane may take:
	// A's lease expires at most TTL after its last renewal; the rest is
	// slack for a loaded machine.
	fenceTakeover = fenceTTL + 20*time.Second
)

// TestFenceRefusesWokenZombieOnPartition: A is frozen right before the
// fence of a batch it fetched, with its transaction open, until B has
// claimed the partition; B is held at its own fence until A has woken.
// A's fence must be refused by Postgres, and every record applied once,
// by B.
func TestFenceRefusesWokenZombieOnPartition(t *testing.T) {
	b := setup(t, 1)
	fn := effects.Function(b.fn, b.topic)
	const n = 30
	produced := b.produceN(t, 1, n)

	lane := inbox.Partition{Consumer: b.fn, Topic: b.topic, Partition: 0}
	race := raceZombie(t, b, lane, "the partition", fn, fn)
	b.waitCaughtUp(t, b.fn)
	race.finish(t, n)
	if got, want := effectTokens(t, b), map[int64]int{race.tB: n}; !maps.Equal(got, want) {
		t.Errorf("effects by the epoch their transaction saw after its fence: %v, want %v (all under B's)", got, want)
	}
	b.check(t, b.fn, produced)
}

// TestFenceRefusesWokenZombieOnMarkerPass is the same for the cursor's
// move over offsets that hold no committed record: the partition holds
// only an aborted transaction (its records and its ABORT marker), so A's
// lane has no record to apply and moves its cursor past them in a fenced
// transaction that claims nothing. A is frozen right before that fence
// until B has claimed the partition; Postgres must refuse A's move under
// its stale token, B moves the cursor to the log end, and a committed
// transaction after it is applied once, by B.
func TestFenceRefusesWokenZombieOnMarkerPass(t *testing.T) {
	b := setup(t, 1)
	fn, table := valueRecorder(b)
	producer := newTxProducer(t, b)
	producer.write(false, "x0", "x1")

	lane := inbox.Partition{Consumer: b.fn, Topic: b.topic, Partition: 0}
	race := raceZombie(t, b, lane, "the partition, past the aborted transaction", fn, fn)
	if race.claimed.NextOffset != 0 {
		t.Fatalf("cursor after B's claim: next offset %d, want 0 (A's move past the aborted transaction never committed)", race.claimed.NextOffset)
	}
	// Kafka writes a transaction's markers after EndTransaction returns:
	// the log end is read again until the cursor is there.
	waitFor(t, 10*time.Second, "B to move the cursor to the log end", func() bool {
		cur := readCursor(t, b, lane)
		return cur.NextOffset == b.kafka.HighWatermarks(t, b.topic)[0] && cur.NextOffset > 2 && cur.Epoch == race.tB
	})
	producer.write(true, "a0")
	waitFor(t, 10*time.Second, "B to apply the committed record", func() bool { return len(appliedValues(t, b, table)) > 0 })
	b.waitCaughtUp(t, b.fn)
	race.finish(t, 1)
	if got := appliedValues(t, b, table); !slices.Equal(got, []string{"a0"}) {
		t.Errorf("applied %q, want [a0]", got)
	}
}

// TestFenceRefusesWokenZombieOnSubject is the same for a NATS-triggered
// function: A, frozen before the fence of events it fetched, is resumed
// after B claimed the subject and recreated its durable consumer.
func TestFenceRefusesWokenZombieOnSubject(t *testing.T) {
	b := setup(t, 1)
	ctx := context.Background()
	js := jetStream(t, b.cfg.NATSURL)
	stream, subject := kfntest.Name(t, "stream"), kfntest.Name(t, "subj")+".created"
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}}); err != nil {
		t.Fatal(err)
	}
	const n = 20
	for i := range n {
		msg := nats.NewMsg(subject)
		msg.Header.Set("Nats-Msg-Id", fmt.Sprintf("ev-%02d", i))
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	table := pgx.Identifier{"events_" + b.fn}.Sanitize()
	// Each applied event records the worker that applied it, and the
	// subject's epoch and whether its transaction wrote the cursor row
	// (its fence), read after the fence in the same transaction.
	fn := func(worker string) runtime.Function {
		return runtime.Function{
			Name: b.fn, Subject: subject, Stream: stream,
			Setup: func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` (event_id text, worker text, token bigint, fenced boolean)`)
				return err
			},
			Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
				_, err := tx.Exec(ctx, `INSERT INTO `+table+`
SELECT $1::text, $2::text, c.epoch, c.xmin = pg_current_xact_id()::xid
  FROM kfn.cursors c WHERE c.consumer = $3 AND c.topic = $4 AND c.partition = 0`, rec.EventID, worker, b.fn, subject)
				return err
			},
		}
	}

	lane := inbox.Partition{Consumer: b.fn, Topic: subject, Partition: 0}
	race := raceZombie(t, b, lane, "the subject", fn("A"), fn("B"))
	b.waitEventsDone(t, js, stream, n, 30*time.Second)
	race.finish(t, n)
	type row struct {
		Event, Worker string
		Token         int64
		Fenced        bool
	}
	rows, err := b.pg.Pool.Query(ctx, `SELECT event_id, worker, token, fenced FROM `+table+` ORDER BY event_id`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	var want []row
	for i := range n {
		want = append(want, row{fmt.Sprintf("ev-%02d", i), "B", race.tB, true})
	}
	if !slices.Equal(got, want) {
		t.Errorf("applied events (id, worker, token, fenced):\n got %v\nwant %v (each event once, by B under its fenced token)", got, want)
	}
}

// TestTakeOverWaitsForAnOlderSessionItCannotEnd: A is frozen right after
// its fence succeeded, so its open transaction holds the cursor row's lock,
// until its lease has expired. A and B run as two roles, neither a
// superuser nor a member of pg_signal_backend, so B may not signal A's
// session: its claim can neither get the lock nor end A's
// transaction: it must be refused and retried, counted in
// kfn_fence_terminate_denied_total, with one WARN that says why, not one
// per retry. Once A wakes, its commit lands (legitimately: nobody claimed
// the partition before it), and B's claim follows it.
func TestTakeOverWaitsForAnOlderSessionItCannotEnd(t *testing.T) {
	b := setup(t, 1)
	a := freezeAfterFence(t, b)
	const n = frozenRecords
	fn, idA, idB, tA, lane := a.fn, a.idA, a.idB, a.tA, a.lane
	holdA, wa, stopA, produced, gate, freezer := a.hold, a.w, a.stop, a.produced, a.gate, a.freezer

	cfgB := b.cfg
	cfgB.DatabaseURL = restrictedRole(t, b)
	logsB := &capturedLogs{}
	cfgB.Logger = slog.New(&logCapture{next: b.cfg.Logger.Handler(), store: logsB})
	wb, stopB := b.runAs(t, cfgB, idB, fn)

	const warning = "cannot end a frozen older owner's Postgres session"
	warnings := func() []capturedLog {
		return logsB.find(func(r capturedLog) bool { return strings.HasPrefix(r.msg, warning) })
	}
	denied := func() int64 { return wb.Stats().Functions()[b.fn].FenceTerminateDenied }
	waitFor(t, fenceTakeover, "B's claim to be refused twice because A's session could not be ended", func() bool { return denied() >= 2 })
	if cur := readCursor(t, b, lane); cur.Epoch != tA || cur.Owner != idA {
		t.Fatalf("cursor while A holds its row lock: epoch %d owner %q, want A's token %d and owner %q", cur.Epoch, cur.Owner, tA, idA)
	}

	holdA.free()
	stoodStill := time.Since(holdA.at)
	var cur inbox.Cursor
	waitFor(t, 30*time.Second, "B's claim to land after A's commit", func() bool {
		cur = readCursor(t, b, lane)
		return cur.Epoch != tA
	})
	landed := time.Now()
	if cur.Owner != idB || cur.NextOffset != n {
		t.Errorf("cursor after B's claim: epoch %d owner %q next offset %d; want owner %q, at %d (after A's commit)", cur.Epoch, cur.Owner, cur.NextOffset, idB, n)
	}
	freezer.end()
	// A's lane, woken with its ctx cancelled, stops; B applies what comes next.
	waitFor(t, 10*time.Second, "A to give the partition up", func() bool {
		if a.second.arrived() {
			t.Fatalf("A fetched a second batch: the test's precondition (A's first batch holds all %d records) failed", n)
		}
		return len(wa.Stats().Partitions()) == 0
	})
	produced = append(produced, b.produceN(t, 1, 10)...)
	b.waitCaughtUp(t, b.fn)
	awaitApplied(wb, 10)
	stopB()
	stopA()

	claimed := logsB.find(func(r capturedLog) bool {
		return r.msg == "claimed" && r.attrs["item"] == "0" && strings.HasSuffix(r.attrs["group"], "/"+b.fn+"/"+b.topic)
	})
	if len(claimed) != 1 {
		t.Fatalf("B logged %d lease claims of the partition, want 1", len(claimed))
	}
	warned := warnings()
	if len(warned) != 1 || !strings.Contains(warned[0].attrs["err"], inbox.ErrCannotEndOlderOwner.Error()) || !strings.Contains(warned[0].msg, "pg_signal_backend") {
		t.Errorf("B logged %d warnings %v, want one that names pg_signal_backend, with the refusal as its err", len(warned), warned)
	}
	if retries := logsB.find(func(r capturedLog) bool {
		return r.level >= slog.LevelInfo && strings.HasSuffix(r.msg, "failed, retrying") && strings.Contains(r.attrs["err"], inbox.ErrCannotEndOlderOwner.Error())
	}); len(retries) != 0 {
		t.Errorf("B logged %d refused claims at info level or above, want none besides the one warning", len(retries))
	}
	refused := denied()
	series := `kfn_fence_terminate_denied_total\{function="` + regexp.QuoteMeta(b.fn) + `",worker="` + regexp.QuoteMeta(idB) + `"\}`
	if got := metric(t, wb, series); got != strconv.FormatInt(refused, 10) {
		t.Errorf("B's kfn_fence_terminate_denied_total = %q, want %d", got, refused)
	}
	if len(warned) == 0 {
		return
	}
	t.Logf("A's lane stood still %s holding the cursor row (lease TTL %s, renewed every %s); B held the lease %s before its claim landed, refused %d times meanwhile; the warning: %s: %s",
		stoodStill.Round(time.Millisecond), fenceTTL, fenceRenew, landed.Sub(claimed[0].at).Round(time.Millisecond), refused, warned[0].msg, warned[0].attrs["err"])
	wantStats(t, "A", wa, stats{applied: n})
	wantStats(t, "B", wb, stats{applied: 10})
	if got, want := effectTokens(t, b), map[int64]int{tA: n, cur.Epoch: 10}; !maps.Equal(got, want) {
		t.Errorf("effects by the epoch their transaction saw after its fence: %v, want %v (A's batch, then B's records)", got, want)
	}
	if got := gate.count(tA, faults.FenceRefused); got != 0 {
		t.Errorf("A's fence was refused %d times, want none: nobody claimed the partition before its commit", got)
	}
	b.check(t, b.fn, produced)
}

// frozenRecords are the records of the takeover tests, all in A's first
// batch.
const frozenRecords = 30

// frozenOwner is worker A of the takeover tests, frozen with its lane's
// transaction open right after the fence of its first batch (the cursor
// row locked), and its lease.
type frozenOwner struct {
	fn       runtime.Function
	idA, idB string // B takes the lane once A's lease has expired
	produced []effects.Produced
	lane     inbox.Partition
	gate     *laneGate
	freezer  *leaseFreezer
	hold     *laneHold // where A is held
	second   *laneHold // a second batch of A's, held at its fence
	tA       int64
	w        *worker.Worker
	stop     func()
}

// freezeAfterFence runs A as a role of its own (not a superuser, no
// pg_signal_backend) and freezes it after the fence of its first batch.
func freezeAfterFence(t *testing.T, b *bundle) *frozenOwner {
	t.Helper()
	b.cfg.LeaseTTL, b.cfg.LeaseRenew = fenceTTL, fenceRenew
	a := &frozenOwner{gate: newLaneGate(t, b.fn), freezer: newLeaseFreezer(t), fn: effects.Function(b.fn, b.topic)}
	t.Cleanup(a.gate.releaseAll)
	t.Cleanup(a.freezer.end)
	a.idA, a.idB = fenceWorkerIDs(b.fn)
	a.produced = b.produceN(t, 1, frozenRecords)
	a.lane = inbox.Partition{Consumer: b.fn, Topic: b.topic, Partition: 0}

	a.hold = a.gate.hold(faults.AfterFence, func(int64) bool { return true })
	cfgA := b.cfg
	cfgA.BatchWait = time.Second // the n records, all in Kafka already, make one batch
	cfgA.DatabaseURL = restrictedRole(t, b)
	a.w, a.stop = b.runAs(t, cfgA, a.idA, a.fn)
	a.tA = a.hold.wait(t, 30*time.Second, "A's lane to pass the fence of its first batch")
	a.freezer.freeze(a.tA)
	// A second batch of A's would race B's claim for the row lock; it is
	// held at its fence (and reported) instead.
	a.second = a.gate.hold(faults.BeforeFence, func(token int64) bool { return token == a.tA })
	return a
}

// TestTakeOverEndsAnotherRolesSessionWithPgSignalBackend: as above, but
// B's role is a member of pg_signal_backend. B's claim ends A's session,
// which rolls A's open transaction back, while A is still frozen, and
// never waits for A: no claim is refused for lack of privilege, and B
// applies every record. A, woken, cannot commit anything.
func TestTakeOverEndsAnotherRolesSessionWithPgSignalBackend(t *testing.T) {
	b := setup(t, 1)
	a := freezeAfterFence(t, b)
	cfgB := b.cfg
	cfgB.DatabaseURL = restrictedRole(t, b, "pg_signal_backend")
	wb, stopB := b.runAs(t, cfgB, a.idB, a.fn)

	var cur inbox.Cursor
	waitFor(t, fenceTakeover, "B's claim to land while A is frozen", func() bool {
		cur = readCursor(t, b, a.lane)
		return cur.Epoch != a.tA
	})
	claimedAfter := time.Since(a.hold.at)
	// B may have applied the records by the time the cursor is read (a CI
	// run against Apache Kafka saw next offset 30 under B): that A's open
	// batch rolled back is checked below, by every effect's epoch and by
	// A's applied count.
	if cur.Owner != a.idB {
		t.Errorf("cursor after B's claim: owner %q; want %q", cur.Owner, a.idB)
	}
	a.hold.free()
	a.freezer.end()
	b.waitCaughtUp(t, b.fn)
	awaitApplied(wb, frozenRecords)
	stopB()
	a.stop()

	t.Logf("B's claim landed %s after A froze holding the cursor row (lease TTL %s, renewed every %s)",
		claimedAfter.Round(time.Millisecond), fenceTTL, fenceRenew)
	if got := wb.Stats().Functions()[b.fn].FenceTerminateDenied; got != 0 {
		t.Errorf("B's claims refused for lack of privilege: %d, want 0 (B is a member of pg_signal_backend)", got)
	}
	if got := a.w.Stats().Applied.Load(); got != 0 {
		t.Errorf("A applied %d records after its session was ended, want 0", got)
	}
	wantStats(t, "B", wb, stats{applied: frozenRecords})
	if got, want := effectTokens(t, b), map[int64]int{cur.Epoch: frozenRecords}; !maps.Equal(got, want) {
		t.Errorf("effects by the epoch their transaction saw after its fence: %v, want %v (all B's)", got, want)
	}
	b.check(t, b.fn, a.produced)
}

// zombieRace is the race each fence test stages on one lane: worker A is
// frozen, its lane and its lease, right before its first fence; B claims
// the lane and is held at its own fence; then A is woken, and Postgres
// alone must refuse A's fence under its stale token.
type zombieRace struct {
	gate         *laneGate
	wa, wb       *worker.Worker
	stopA, stopB func()
	tA, tB       int64
	// claimed is the lane's cursor right after B's claim.
	claimed inbox.Cursor
	// stoodStill is how long A's lane was held before its fence;
	// bReachedFence how long after A froze B was at its own.
	stoodStill, bReachedFence time.Duration
}

// raceZombie runs A (fnA) and B (fnB) on lane, named where in messages,
// through A's refused fence, then lets B go on. The caller waits for B's
// work, then calls finish.
func raceZombie(t *testing.T, b *bundle, lane inbox.Partition, where string, fnA, fnB runtime.Function) *zombieRace {
	t.Helper()
	b.cfg.LeaseTTL, b.cfg.LeaseRenew = fenceTTL, fenceRenew
	r := &zombieRace{gate: newLaneGate(t, b.fn)}
	freezer := newLeaseFreezer(t)
	t.Cleanup(r.gate.releaseAll)
	t.Cleanup(freezer.end)
	idA, idB := fenceWorkerIDs(b.fn)

	holdA := r.gate.hold(faults.BeforeFence, func(int64) bool { return true })
	r.wa, r.stopA = b.runAs(t, b.cfg, idA, fnA)
	r.tA = holdA.wait(t, 30*time.Second, "A to reach its first fence on "+where)
	freezer.freeze(r.tA)

	holdB := r.gate.hold(faults.BeforeFence, func(token int64) bool { return token != r.tA })
	r.wb, r.stopB = b.runAs(t, b.cfg, idB, fnB)
	r.tB = holdB.wait(t, fenceTakeover, "B to claim "+where+" and reach its own fence")
	r.claimed = readCursor(t, b, lane)
	if r.claimed.Epoch != r.tB || r.claimed.Owner != idB || r.tB <= r.tA {
		t.Fatalf("cursor after B's claim of %s: epoch %d owner %q; want B's token %d (A's is %d) and owner %q",
			where, r.claimed.Epoch, r.claimed.Owner, r.tB, r.tA, idB)
	}

	holdA.free()
	r.stoodStill = time.Since(holdA.at)
	switch r.gate.waitPassage(t, 10*time.Second, r.tA, faults.FenceRefused, faults.AfterFence) {
	case faults.AfterFence:
		t.Errorf("Postgres accepted the fence of A's woken transaction on %s under its stale token %d, after B claimed it with %d", where, r.tA, r.tB)
	case faults.FenceRefused:
		waitFor(t, 10*time.Second, "A to drop "+where+" as fenced", func() bool { return r.wa.Stats().Fenced.Load() == 1 })
	}
	r.bReachedFence = holdB.at.Sub(holdA.at)
	holdB.free()
	freezer.end()
	return r
}

// finish stops both workers once B has counted appliedByB records, and
// checks that A was fenced once and never passed a fence under its token.
func (r *zombieRace) finish(t *testing.T, appliedByB int64) {
	t.Helper()
	awaitApplied(r.wb, appliedByB)
	r.stopB()
	r.stopA()
	t.Logf("A's lane stood still %s before its fence (lease TTL %s, renewed every %s); B reached its fence %s after A froze",
		r.stoodStill.Round(time.Millisecond), fenceTTL, fenceRenew, r.bReachedFence.Round(time.Millisecond))
	wantStats(t, "A", r.wa, stats{fenced: 1})
	wantStats(t, "B", r.wb, stats{applied: appliedByB})
	if got := r.gate.count(r.tA, faults.AfterFence); got != 0 {
		t.Errorf("A passed %d fences under its stale token", got)
	}
}

// fenceWorkerIDs names workers A and B so that the lease item "0" (the
// partition, or the subject's single lane) is B's when both are members.
func fenceWorkerIDs(fn string) (a, b string) {
	a = fn + "-a"
	for i := 0; ; i++ {
		b = fmt.Sprintf("%s-b%d", fn, i)
		if lease.Assign([]string{a, b}, []string{"0"})["0"] == b {
			return a, b
		}
	}
}

// runAs is bundle.run with cfg, under the worker id id.
func (b *bundle) runAs(t *testing.T, cfg runtime.Config, id string, fn runtime.Function) (*worker.Worker, func()) {
	t.Helper()
	cfg.WorkerID = id
	w, err := worker.New(context.Background(), cfg, fn)
	if err != nil {
		t.Fatalf("start worker %s: %v", id, err)
	}
	return w, kfntest.Background(t, "worker "+id, w.Run)
}

func readCursor(t *testing.T, b *bundle, p inbox.Partition) inbox.Cursor {
	t.Helper()
	cur, err := inbox.ReadCursor(context.Background(), b.pg.Pool, p)
	if err != nil {
		t.Fatal(err)
	}
	return cur
}

// effectTokens counts the effects of the test function by the epoch their
// transaction read from the cursor row after its fence (see effects).
func effectTokens(t *testing.T, b *bundle) map[int64]int {
	t.Helper()
	rows, err := b.pg.Pool.Query(context.Background(), `SELECT token, count(*) FROM `+effects.Table(b.fn)+` GROUP BY token`)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int64]int{}
	var token int64
	var n int
	_, err = pgx.ForEachRow(rows, []any{&token, &n}, func() error {
		out[token] = n
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// awaitApplied gives worker w up to 10 s to count n applied records. A
// commit is visible in Postgres before its reply reaches the worker, and
// a worker stopped in between loses the reply (and the count); its stats
// are compared only after this wait.
func awaitApplied(w *worker.Worker, n int64) {
	for deadline := time.Now().Add(10 * time.Second); w.Stats().Applied.Load() < n && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
}

type stats struct{ applied, duplicates, fenced int64 }

func wantStats(t *testing.T, name string, w *worker.Worker, want stats) {
	t.Helper()
	s := w.Stats()
	if got := (stats{s.Applied.Load(), s.Duplicates.Load(), s.Fenced.Load()}); got != want {
		t.Errorf("worker %s: applied %d, skipped as duplicates %d, lanes fenced %d; want %d, %d, %d",
			name, got.applied, got.duplicates, got.fenced, want.applied, want.duplicates, want.fenced)
	}
}

// restrictedRole creates a login role that is not a superuser, with the
// privileges a worker needs in the test's database, and the roles of
// memberOf (none: no pg_signal_backend), and returns a URL of the database
// for it. It cannot signal the
// sessions of another role: the superuser the other workers run as, or
// another restricted role.
func restrictedRole(t *testing.T, b *bundle, memberOf ...string) string {
	t.Helper()
	role := strings.ToLower(strings.ReplaceAll(kfntest.Name(t, "role"), "-", "_"))
	const password = "kfn-test"
	quoted := pgx.Identifier{role}.Sanitize()
	execSQL(t, b, `CREATE ROLE `+quoted+` LOGIN NOSUPERUSER PASSWORD '`+password+`'`)
	t.Cleanup(func() {
		for _, sql := range []string{`DROP OWNED BY ` + quoted, `DROP ROLE ` + quoted} {
			if _, err := b.pg.Pool.Exec(context.Background(), sql); err != nil {
				t.Errorf("%s: %v", sql, err)
			}
		}
	})
	for _, sql := range []string{
		`GRANT USAGE, CREATE ON SCHEMA kfn, public TO ` + quoted,
		`GRANT ALL ON ALL TABLES IN SCHEMA kfn, public TO ` + quoted,
		`GRANT ALL ON ALL SEQUENCES IN SCHEMA kfn, public TO ` + quoted,
		// Bound to every function: row-level security (migration 11)
		// shows a role created after the migration no row otherwise.
		`INSERT INTO kfn.function_roles (role_name, consumer) VALUES ('` + role + `', '*')`,
	} {
		execSQL(t, b, sql)
	}
	for _, group := range memberOf {
		execSQL(t, b, `GRANT `+pgx.Identifier{group}.Sanitize()+` TO `+quoted)
	}
	var super bool
	if err := b.pg.Pool.QueryRow(context.Background(), `SELECT rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&super); err != nil || !super {
		t.Fatalf("the tests' own role must be a superuser for this test (superuser: %v, %v)", super, err)
	}
	u, err := url.Parse(b.pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(role, password)
	return u.String()
}

// laneGate watches the fence points that the lanes of one function pass
// (faults.LaneHook) and holds a lane at a point when the test asks.
type laneGate struct {
	fn     string
	mu     sync.Mutex
	passed []passage
	holds  []*laneHold
}

type passage struct {
	point faults.LanePoint
	token int64
}

// laneHold holds the first lane that reaches point with a token that
// match accepts, until free.
type laneHold struct {
	point   faults.LanePoint
	match   func(token int64) bool
	came    chan struct{} // closed when a lane arrives
	token   int64         // the held lane's token, set before came is closed
	at      time.Time     // when it arrived
	release chan struct{}
	once    sync.Once
}

func newLaneGate(t *testing.T, fn string) *laneGate {
	g := &laneGate{fn: fn}
	t.Cleanup(faults.SetLaneHook(g.hook))
	return g
}

func (g *laneGate) hook(p faults.LanePoint, lane inbox.Partition, token int64) {
	if lane.Consumer != g.fn {
		return
	}
	g.mu.Lock()
	g.passed = append(g.passed, passage{p, token})
	var held *laneHold
	for _, h := range g.holds {
		if !h.arrived() && h.point == p && h.match(token) {
			held = h
			h.token, h.at = token, time.Now()
			close(h.came)
			break
		}
	}
	g.mu.Unlock()
	if held != nil {
		<-held.release
	}
}

func (g *laneGate) hold(p faults.LanePoint, match func(token int64) bool) *laneHold {
	g.mu.Lock()
	defer g.mu.Unlock()
	h := &laneHold{point: p, match: match, came: make(chan struct{}), release: make(chan struct{})}
	g.holds = append(g.holds, h)
	return h
}

// releaseAll frees every hold, so that workers can stop when a test ends
// early.
func (g *laneGate) releaseAll() {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, h := range g.holds {
		h.free()
	}
}

// count is how many times lanes with token passed point.
func (g *laneGate) count(token int64, point faults.LanePoint) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := 0
	for _, p := range g.passed {
		if p.token == token && p.point == point {
			n++
		}
	}
	return n
}

// waitPassage waits until a lane with token passes one of points and
// returns the point.
func (g *laneGate) waitPassage(t *testing.T, limit time.Duration, token int64, points ...faults.LanePoint) faults.LanePoint {
	t.Helper()
	var found faults.LanePoint
	waitFor(t, limit, fmt.Sprintf("the lane with token %d to pass one of %v", token, points), func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		for _, p := range g.passed {
			if p.token == token && slices.Contains(points, p.point) {
				found = p.point
				return true
			}
		}
		return false
	})
	return found
}

func (h *laneHold) arrived() bool {
	select {
	case <-h.came:
		return true
	default:
		return false
	}
}

// wait waits for a lane to arrive at the hold and returns its token.
func (h *laneHold) wait(t *testing.T, limit time.Duration, what string) int64 {
	t.Helper()
	select {
	case <-h.came:
		return h.token
	case <-time.After(limit):
		t.Fatalf("timed out after %s waiting for %s", limit, what)
		return 0
	}
}

func (h *laneHold) free() { h.once.Do(func() { close(h.release) }) }

// leaseFreezer freezes lease claims by token (lease.Freeze) until
// end.
type leaseFreezer struct {
	mu     sync.Mutex
	tokens map[uint64]bool
	thaw   chan struct{}
	once   sync.Once
}

// newLeaseFreezer installs a freezer; do it before the workers start.
func newLeaseFreezer(t *testing.T) *leaseFreezer {
	f := &leaseFreezer{tokens: map[uint64]bool{}, thaw: make(chan struct{})}
	t.Cleanup(lease.SetFreeze(f.frozen))
	return f
}

func (f *leaseFreezer) freeze(token int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.tokens[uint64(token)] = true
}

func (f *leaseFreezer) frozen(item string, token uint64) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.tokens[token] {
		return f.thaw
	}
	return nil
}

func (f *leaseFreezer) end() { f.once.Do(func() { close(f.thaw) }) }

// logCapture keeps a worker's log records, Debug ones included (the
// per-lease "claimed" is one), and passes every record on to next, the
// test log, if next takes its level.
type logCapture struct {
	next  slog.Handler
	attrs []slog.Attr
	store *capturedLogs
}

type capturedLogs struct {
	mu   sync.Mutex
	recs []capturedLog
}

type capturedLog struct {
	at    time.Time
	level slog.Level
	msg   string
	attrs map[string]string
}

func (c *logCapture) Enabled(context.Context, slog.Level) bool { return true }

func (c *logCapture) Handle(ctx context.Context, r slog.Record) error {
	rec := capturedLog{at: r.Time, level: r.Level, msg: r.Message, attrs: map[string]string{}}
	for _, a := range c.attrs {
		rec.attrs[a.Key] = a.Value.String()
	}
	r.Attrs(func(a slog.Attr) bool {
		rec.attrs[a.Key] = a.Value.String()
		return true
	})
	c.store.mu.Lock()
	c.store.recs = append(c.store.recs, rec)
	c.store.mu.Unlock()
	if c.next.Enabled(ctx, r.Level) {
		return c.next.Handle(ctx, r)
	}
	return nil
}

func (c *logCapture) WithAttrs(as []slog.Attr) slog.Handler {
	return &logCapture{next: c.next.WithAttrs(as), attrs: append(slices.Clone(c.attrs), as...), store: c.store}
}

func (c *logCapture) WithGroup(name string) slog.Handler {
	return &logCapture{next: c.next.WithGroup(name), attrs: c.attrs, store: c.store}
}

func (s *capturedLogs) find(match func(capturedLog) bool) []capturedLog {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []capturedLog
	for _, r := range s.recs {
		if match(r) {
			out = append(out, r)
		}
	}
	return out
}
