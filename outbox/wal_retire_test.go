package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// errorCounter is a slog handler that counts the records at levels
// Warn and Error.
type errorCounter struct {
	warnings, errors atomic.Int64
	last             atomic.Value // string: the last error's message
}

func (c *errorCounter) Enabled(context.Context, slog.Level) bool { return true }
func (c *errorCounter) Handle(_ context.Context, r slog.Record) error {
	switch {
	case r.Level >= slog.LevelError:
		c.errors.Add(1)
		c.last.Store(r.Message)
	case r.Level >= slog.LevelWarn:
		c.warnings.Add(1)
	}
	return nil
}
func (c *errorCounter) WithAttrs([]slog.Attr) slog.Handler { return c }
func (c *errorCounter) WithGroup(string) slog.Handler      { return c }

// retireAndDrop runs the retirement's steps as `kfn migrate
// --drop-wal-outbox` does, with a relay reading the slot.
func (f *relayFixture) retireAndDrop(timeout time.Duration) (WALState, WALDrop) {
	f.t.Helper()
	ctx := context.Background()
	st, err := RetireWAL(ctx, f.db.Pool, timeout)
	if err != nil {
		f.t.Fatalf("retire: %v", err)
	}
	for deadline := time.Now().Add(timeout); !st.Drained(); {
		if time.Now().After(deadline) {
			f.t.Fatalf("not drained after %v: %+v", timeout, st)
		}
		time.Sleep(20 * time.Millisecond)
		if st, err = ReadWALState(ctx, f.db.Pool); err != nil {
			f.t.Fatal(err)
		}
	}
	dropped, err := DropRetiredWAL(ctx, f.db.Pool)
	if err != nil {
		f.t.Fatalf("drop: %v", err)
	}
	return st, dropped
}

// requireWALGone checks that the slot, the publication and the row are gone.
func (f *relayFixture) requireWALGone(slot string) {
	f.t.Helper()
	var slots, pubs, rows int
	err := f.db.Pool.QueryRow(context.Background(), `
SELECT (SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1),
       (SELECT count(*) FROM pg_publication WHERE pubname = $2),
       (SELECT count(*) FROM kfn.wal_outbox)`, slot, WALPublication).Scan(&slots, &pubs, &rows)
	if err != nil || slots+pubs+rows != 0 {
		f.t.Fatalf("after the drop: %d slots, %d publications, %d kfn.wal_outbox rows (%v); want none", slots, pubs, rows, err)
	}
}

// TestRetiringTheWALOutboxUnderLoadRelaysEveryEventOnceThenDropsTheSlot
// has writers emit into the WAL without pause, as workers in wal mode
// do, while the relay reads the slot; then the writers switch to table
// mode, one at a time, and the WAL outbox is retired and dropped with the
// relay running: every event reaches the stream once, the slot, the
// publication and the row are gone, and the relay never reports the slot
// lost nor logs an error. A writer still in wal mode during the
// retirement is refused with SQLSTATE 55000 (it retries, as a worker
// does) until it switches, and its events are written once, in table
// mode.
func TestRetiringTheWALOutboxUnderLoadRelaysEveryEventOnceThenDropsTheSlot(t *testing.T) {
	t.Parallel()
	f := newWALFixture(t)
	ctx := context.Background()
	counter := &errorCounter{}
	cfg := f.config() // a relay in table mode, as after the switch back: it drains the slot too
	cfg.WorkerID, cfg.StatusInterval, cfg.Logger = t.Name(), 100*time.Millisecond, slog.New(counter)
	relay, stop := f.startRelay(cfg)
	defer stop()

	const writers = 3
	var mu sync.Mutex
	var committed []Row
	modes := make([]atomic.Value, writers)
	var refused atomic.Int64
	stopWriting := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := range writers {
		modes[w].Store(ModeWAL)
		wg.Add(1)
		go func() {
			defer wg.Done()
			keys := keyNames(fmt.Sprintf("w%d-", w), 5)
			for {
				select {
				case <-stopWriting:
					return
				default:
				}
				rows := f.newRows(keys, 1)
				for {
					m := modes[w].Load().(Mode)
					err := pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error { return Write(ctx, tx, m, rows) })
					if err == nil {
						break
					}
					var pgErr *pgconn.PgError
					if m != ModeWAL || !errors.As(err, &pgErr) || pgErr.Code != "55000" || !strings.Contains(pgErr.Message, "is being retired") || !strings.Contains(pgErr.Hint, "--outbox table") {
						errs <- fmt.Errorf("writer %d in %s mode: %w", w, m, err)
						return
					}
					refused.Add(1) // retried, as a worker retries 55000
					time.Sleep(5 * time.Millisecond)
				}
				mu.Lock()
				committed = append(committed, rows...)
				mu.Unlock()
				time.Sleep(2 * time.Millisecond)
			}
		}()
	}
	time.Sleep(700 * time.Millisecond)
	modes[0].Store(ModeTable)
	modes[1].Store(ModeTable)
	// Writer 2 stays in wal mode through the retirement, until its
	// emits have been refused a few times.
	retired := make(chan struct{})
	go func() {
		defer close(retired)
		for deadline := time.Now().Add(20 * time.Second); refused.Load() < 3 && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
		modes[2].Store(ModeTable)
	}()
	st, dropped := f.retireAndDrop(30 * time.Second)
	<-retired
	time.Sleep(300 * time.Millisecond) // table mode after the drop
	close(stopWriting)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if refused.Load() < 3 {
		t.Fatalf("the writer left in wal mode was refused %d times during the retirement, want at least 3", refused.Load())
	}
	mu.Lock()
	all := slices.Clone(committed)
	mu.Unlock()
	f.waitDelivered(len(all), 30*time.Second)
	rep := checkDelivery(f.readStream(), all)
	if rep.lost+rep.duplicated+rep.unexpected != 0 {
		t.Fatalf("%d events: lost %d, duplicated %d, unexpected %d\n%s", len(all), rep.lost, rep.duplicated, rep.unexpected, strings.Join(rep.problems, "\n"))
	}
	f.requireWALGone(dropped.Slot)
	// The relay's session ended with its walsender (one warning); then it
	// tries the slot again every RetryMax, quietly.
	warnings := counter.warnings.Load()
	time.Sleep(3 * cfg.RetryMax)
	if s := relay.Stats(); s.WAL.SlotLost || counter.errors.Load() != 0 || counter.warnings.Load() != warnings {
		t.Fatalf("after the drop the relay reports slot lost %v, logged %d errors (last %v) and %d warnings", s.WAL.SlotLost, counter.errors.Load(), counter.last.Load(), counter.warnings.Load()-warnings)
	}
	if !st.LostAt.IsZero() {
		t.Fatalf("the retired outbox was marked lost at %v", st.LostAt)
	}
	t.Logf("%d events across the retirement, each once in the stream; the writer left in wal mode was refused %d times; walsender ended: pid %d", len(all), refused.Load(), dropped.Terminated)
}

// TestRetiringTheWALOutboxWaitsForTheTransactionsThatEmitted opens a
// transaction that emits, then retires: bound to 300ms, the retirement
// fails and says why; unbound, it waits for it (it holds ACCESS SHARE on
// kfn.wal_outbox from its emit to its end) while readers of the table
// get through between its lock attempts, and the transaction's events,
// committed before the retirement, are relayed. A
// transaction begun before the retirement that first emits after it is
// refused. Then the second retirement and drop find nothing to do.
func TestRetiringTheWALOutboxWaitsForTheTransactionsThatEmitted(t *testing.T) {
	t.Parallel()
	f := newWALFixture(t)
	ctx := context.Background()
	open, err := f.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer open.Rollback(ctx) //nolint:errcheck // committed below
	early := f.newRows([]string{"early"}, 3)
	if err := Write(ctx, open, ModeWAL, early); err != nil {
		t.Fatal(err)
	}
	late, err := f.db.Pool.Begin(ctx) // begun before the retirement, emits after it
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx) //nolint:errcheck // refused below
	if _, err := late.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatal(err)
	}

	if _, err := RetireWAL(ctx, f.db.Pool, 300*time.Millisecond); err == nil || !strings.Contains(err.Error(), "did not end within 300ms") {
		t.Fatalf("a retirement bound to 300ms while a transaction that emitted is open: %v", err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := RetireWAL(ctx, f.db.Pool, 30*time.Second)
		done <- err
	}()
	waitUntil(t, 10*time.Second, "the retirement to wait for the emitting transaction's lock", func() bool {
		var waiting bool
		err := f.db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE relation = 'kfn.wal_outbox'::regclass AND mode = 'AccessExclusiveLock' AND NOT granted)`).Scan(&waiting)
		return err == nil && waiting
	})
	// Readers of kfn.wal_outbox (kfn status, the metrics, the relay's
	// report) get through between the retirement's lock attempts.
	readCtx, cancel := context.WithTimeout(ctx, 3*time.Second) // lockAttempt is 1s
	_, err = ReadWALState(readCtx, f.db.Pool)
	cancel()
	if err != nil {
		t.Fatalf("reading the WAL outbox's state while the retirement waits: %v", err)
	}
	select {
	case err := <-done:
		t.Fatalf("the retirement ended while a transaction that emitted was open: %v", err)
	case <-time.After(lockAttempt + 200*time.Millisecond):
	}
	if err := open.Commit(ctx); err != nil {
		t.Fatalf("commit of the transaction that emitted before the retirement: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("retire: %v", err)
	}
	err = Write(ctx, late, ModeWAL, f.newRows([]string{"late"}, 1))
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55000" || !strings.Contains(pgErr.Message, "being retired") {
		t.Fatalf("an emit after the retirement: %v; want SQLSTATE 55000 saying it is being retired", err)
	}
	if err := CheckWAL(ctx, f.db.Pool); !errors.Is(err, ErrWALRetired) {
		t.Fatalf("CheckWAL of a retired outbox: %v", err)
	}
	if _, err := DropRetiredWAL(ctx, f.db.Pool); !errors.Is(err, ErrWALNotDrained) {
		t.Fatalf("drop before any relay read the slot: %v; want ErrWALNotDrained", err)
	}

	relay, stop := f.startRelay(f.walConfig())
	defer stop()
	_, dropped := f.retireAndDrop(30 * time.Second)
	f.waitDelivered(len(early), 30*time.Second)
	f.requireExactlyOnceInOrder(early)
	f.requireWALGone(dropped.Slot)
	if relay.Stats().WAL.SlotLost {
		t.Error("the relay reports the retired slot lost")
	}
	if _, err := RetireWAL(ctx, f.db.Pool, time.Second); !errors.Is(err, ErrWALNotSetUp) {
		t.Errorf("a second retirement: %v; want ErrWALNotSetUp", err)
	}
	if _, err := DropRetiredWAL(ctx, f.db.Pool); !errors.Is(err, ErrWALNotSetUp) {
		t.Errorf("a second drop: %v; want ErrWALNotSetUp", err)
	}
	if _, err := SetUpWAL(ctx, f.db.Pool); err != nil {
		t.Fatalf("set up afresh after the drop: %v", err)
	}
	if err := CheckWAL(ctx, f.db.Pool); err != nil {
		t.Fatalf("CheckWAL after setting up afresh: %v", err)
	}
}

// TestARetiredWALOutboxWhoseSlotIsGoneIsNotSlotLoss drops the slot of a
// retired, drained WAL outbox by hand before DropRetiredWAL: a relay
// then finds the slot gone and stops reading it quietly (no slot-lost
// report, no lost_at), kfn status does not call it lost, and
// DropRetiredWAL still finishes the job.
func TestARetiredWALOutboxWhoseSlotIsGoneIsNotSlotLoss(t *testing.T) {
	t.Parallel()
	f := newWALFixture(t)
	ctx := context.Background()
	st, err := RetireWAL(ctx, f.db.Pool, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.db.Pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, st.Slot); err != nil {
		t.Fatal(err)
	}
	counter := &errorCounter{}
	cfg := f.walConfig()
	cfg.Logger = slog.New(counter)
	relay, stop := f.startRelay(cfg)
	defer stop()
	time.Sleep(3 * cfg.RetryMax)
	if st, err = ReadWALState(ctx, f.db.Pool); err != nil {
		t.Fatal(err)
	}
	if relay.Stats().WAL.SlotLost || !st.LostAt.IsZero() || st.Lost() || !st.Drained() || counter.errors.Load()+counter.warnings.Load() != 0 {
		t.Fatalf("a retired outbox without its slot: relay reports lost %v, state %+v (lost %v, drained %v), %d errors and %d warnings logged (last error %v)",
			relay.Stats().WAL.SlotLost, st, st.Lost(), st.Drained(), counter.errors.Load(), counter.warnings.Load(), counter.last.Load())
	}
	dropped, err := DropRetiredWAL(ctx, f.db.Pool)
	if err != nil || dropped.SlotDropped {
		t.Fatalf("drop after the slot went: %+v, %v; want the publication and the row dropped", dropped, err)
	}
	f.requireWALGone(st.Slot)
}

// roleWithoutReplication makes a login role with every right on kfn's
// tables and CREATE on the database, but not REPLICATION, and returns it
// with a pool connected as it.
func (f *relayFixture) roleWithoutReplication() (string, *pgxpool.Pool) {
	f.t.Helper()
	ctx := context.Background()
	role := fmt.Sprintf("norepl_%d", time.Now().UnixNano()%1e9)
	if _, err := f.db.Pool.Exec(ctx, `CREATE ROLE `+role+` LOGIN; GRANT ALL ON SCHEMA kfn TO `+role+`; GRANT ALL ON ALL TABLES IN SCHEMA kfn TO `+role+`; GRANT CREATE ON DATABASE `+pgx.Identifier{f.db.Database}.Sanitize()+` TO `+role); err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() {
		f.db.Pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) //nolint:errcheck // best effort
	})
	cfg := f.db.Pool.Config().Copy()
	cfg.ConnConfig.User = role
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(pool.Close)
	return role, pool
}

// TestDropRetiredWALNamesTheMissingReplicationPrivilege drops a retired,
// drained WAL outbox as a role without REPLICATION: it fails, says so,
// and leaves the outbox retired (the row is kept), so that a run with
// the right finishes it.
func TestDropRetiredWALNamesTheMissingReplicationPrivilege(t *testing.T) {
	t.Parallel()
	f := newWALFixture(t)
	ctx := context.Background()
	_, pool := f.roleWithoutReplication()
	_, stop := f.startRelay(f.walConfig())
	st, err := RetireWAL(ctx, f.db.Pool, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 30*time.Second, "the slot to be drained", func() bool {
		st, err = ReadWALState(ctx, f.db.Pool)
		return err == nil && st.Drained()
	})
	stop()
	_, err = DropRetiredWAL(ctx, pool)
	if err == nil || !containsAll(err.Error(), "drop the replication slot", "lacks REPLICATION", "rds_replication") {
		t.Fatalf("drop without REPLICATION: %v", err)
	}
	if st, err := ReadWALState(ctx, f.db.Pool); err != nil || !st.SetUp || !st.SlotExists || st.RetiredAt.IsZero() {
		t.Fatalf("after the refused drop: %+v (%v); want it retired, with its slot", st, err)
	}
	if _, err := DropRetiredWAL(ctx, f.db.Pool); err != nil {
		t.Fatalf("drop with REPLICATION: %v", err)
	}
	f.requireWALGone(st.Slot)
}

// TestSetUpWALTakesARetiredWALOutboxBack retires the WAL outbox, then
// sets it up again before it is dropped: emits are accepted again, with
// the same slot.
func TestSetUpWALTakesARetiredWALOutboxBack(t *testing.T) {
	t.Parallel()
	f := newWALFixture(t)
	ctx := context.Background()
	retired, err := RetireWAL(ctx, f.db.Pool, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := CheckWAL(ctx, f.db.Pool); !errors.Is(err, ErrWALRetired) {
		t.Fatalf("CheckWAL when retired: %v", err)
	}
	setup, err := SetUpWAL(ctx, f.db.Pool)
	if err != nil || setup.CreatedSlot || setup.Slot != retired.Slot {
		t.Fatalf("set up after the retirement: %+v, %v; want the same slot, kept", setup, err)
	}
	if err := CheckWAL(ctx, f.db.Pool); err != nil {
		t.Fatalf("CheckWAL after setting up again: %v", err)
	}
	rows := f.newRows([]string{"back"}, 2)
	f.emit(rows)
	_, stop := f.startRelay(f.walConfig())
	defer stop()
	f.waitDelivered(len(rows), 30*time.Second)
	f.requireExactlyOnceInOrder(rows)
}
