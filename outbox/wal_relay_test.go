package outbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// walFixture is a relay fixture whose database has the WAL outbox set up.
func newWALFixture(t testing.TB) *relayFixture {
	t.Helper()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	if _, err := SetUpWAL(context.Background(), f.db.Pool); err != nil {
		t.Fatalf("set up the WAL outbox: %v", err)
	}
	return f
}

// emit writes rows into the WAL in one transaction.
func (f *relayFixture) emit(rows []Row) {
	f.t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error { return Write(ctx, tx, ModeWAL, rows) }); err != nil {
		f.t.Fatalf("emit %d events: %v", len(rows), err)
	}
}

func (f *relayFixture) walConfig() RelayConfig {
	cfg := f.config()
	cfg.Mode = ModeWAL
	cfg.WorkerID = f.t.Name()
	cfg.StatusInterval = 100 * time.Millisecond
	return cfg
}

// waitWALDrained waits until the slot's reader reports no pending event
// and a confirmed position at or past the server's WAL position taken now.
func (f *relayFixture) waitWALDrained(timeout time.Duration) WALState {
	f.t.Helper()
	ctx := context.Background()
	var target string
	if err := f.db.Pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&target); err != nil {
		f.t.Fatal(err)
	}
	deadline := time.Now().Add(timeout)
	for {
		var done bool
		err := f.db.Pool.QueryRow(ctx, `SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots s JOIN kfn.wal_outbox w USING (slot_name)`, target).Scan(&done)
		if err != nil {
			f.t.Fatal(err)
		}
		st, err := ReadWALState(ctx, f.db.Pool)
		if err != nil {
			f.t.Fatal(err)
		}
		if done && st.Pending == 0 {
			return st
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("after %v the slot is not confirmed past %s: %+v", timeout, target, st)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestWALRelayPublishesCommittedEventsOnceInPerKeyOrder emits events with
// hostile keys in many transactions (one rolled back) and relays them
// from the slot: each committed event reaches the stream once, in per-key
// commit order, with the message a table row gives; the rolled-back ones
// never; and the slot is confirmed past all of them.
func TestWALRelayPublishesCommittedEventsOnceInPerKeyOrder(t *testing.T) {
	t.Parallel()
	f := newWALFixture(t)
	relay, stop := f.startRelay(f.walConfig())
	defer stop()
	keys := append(keyNames("k", 20), binaryKeys...)
	var committed []Row
	for range 10 {
		rows := f.newRows(keys, 3)
		f.emit(rows)
		committed = append(committed, rows...)
	}
	ctx := context.Background()
	rolledBack := f.newRows(keys, 1)
	tx, err := f.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := Write(ctx, tx, ModeWAL, rolledBack); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	f.waitDelivered(len(committed), 30*time.Second)
	msgs := f.requireExactlyOnceInOrder(committed)
	requirePublishedOnce(t, relay, len(committed))
	for i, m := range msgs {
		if m.Header.Get(HeaderSource) != CloudEventsSourcePrefix+"fn-test" || m.Header.Get(HeaderSourceTopic) != "in" {
			t.Fatalf("message %d: headers %v", i, m.Header)
		}
	}
	st := f.waitWALDrained(10 * time.Second)
	if st.Reader != t.Name() || st.LagBytes < 0 || st.ReportedAt.IsZero() || st.ConfirmedAt.IsZero() {
		t.Errorf("WAL state after the drain: %+v", st)
	}
}

// fixedLease is a SlotLease that holds the slot with one token until its
// ctx ends: a relay that believes it holds the lease whatever happens (a
// zombie that woke up after a takeover, before its renewal failed).
type fixedLease struct{ token uint64 }

func (l fixedLease) Run(ctx context.Context, work func(context.Context, uint64)) error {
	work(ctx, l.token)
	return nil
}

// TestWALRelayWithAnOlderTokenIsFencedOffTheSlot runs a relay on the slot
// with token 1, then a second with token 2 while the first still believes
// it holds the lease: the second ends the first's walsender and reads the
// slot, the first cannot read it again (its token is below the fence) and
// publishes nothing more, and every event reaches the stream once, in
// per-key order, with the slot confirmed past all of them.
func TestWALRelayWithAnOlderTokenIsFencedOffTheSlot(t *testing.T) {
	t.Parallel()
	f := newWALFixture(t)
	cfgA := f.walConfig()
	cfgA.SlotLease, cfgA.WorkerID = fixedLease{token: 1}, "relay-a"
	relayA, stopA := f.startRelay(cfgA)
	defer stopA()
	keys := keyNames("k", 10)
	var committed []Row
	for range 5 {
		rows := f.newRows(keys, 2)
		f.emit(rows)
		committed = append(committed, rows...)
	}
	f.waitDelivered(len(committed), 30*time.Second)
	// The stream holds them before A has taken every ack: wait until A
	// counts them all, so that none of them counts as published after
	// the takeover.
	for deadline := time.Now().Add(30 * time.Second); relayA.Stats().Published+relayA.Stats().Duplicates < uint64(len(committed)); {
		if time.Now().After(deadline) {
			t.Fatalf("relay A counts %+v after 30s, want %d published", relayA.Stats(), len(committed))
		}
		time.Sleep(10 * time.Millisecond)
	}

	cfgB := f.walConfig()
	cfgB.SlotLease, cfgB.WorkerID = fixedLease{token: 2}, "relay-b"
	tookOver := time.Now()
	relayB, stopB := f.startRelay(cfgB)
	defer stopB()
	ctx := context.Background()
	for {
		st, err := ReadWALState(ctx, f.db.Pool)
		if err != nil {
			t.Fatal(err)
		}
		// B's walsender is the one on the slot: the fence names B at once,
		// while A's walsender, terminated by B, may still hold the slot.
		var readerPID int
		if err := f.db.Pool.QueryRow(ctx, `SELECT coalesce(reader_pid, 0) FROM kfn.wal_outbox`).Scan(&readerPID); err != nil {
			t.Fatal(err)
		}
		if st.Reader == "relay-b" && st.ActivePID != 0 && st.ActivePID == readerPID {
			t.Logf("relay B reads the slot %v after it started", time.Since(tookOver).Round(time.Millisecond))
			break
		}
		if time.Since(tookOver) > 15*time.Second {
			t.Fatalf("relay B does not read the slot after 15s: %+v", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	publishedByA := relayA.Stats().Published + relayA.Stats().Duplicates
	for range 5 {
		rows := f.newRows(keys, 2)
		f.emit(rows)
		committed = append(committed, rows...)
	}
	f.waitDelivered(len(committed), 30*time.Second)
	f.requireExactlyOnceInOrder(committed)
	f.waitWALDrained(10 * time.Second)
	if got := relayA.Stats().Published + relayA.Stats().Duplicates; got != publishedByA {
		t.Errorf("the fenced relay A published %d events after B took the slot over", got-publishedByA)
	}
	if st := relayB.Stats(); st.Published == 0 {
		t.Errorf("relay B published nothing: %+v", st)
	}
	var token int64
	if err := f.db.Pool.QueryRow(ctx, `SELECT fence_token FROM kfn.wal_outbox`).Scan(&token); err != nil || token != 2 {
		t.Errorf("the slot's fence is %d (%v), want 2", token, err)
	}
}

// TestWALEmitRefusesWhileTheSlotIsGone drops the slot while events wait
// in it: the relay reports the slot lost, and a transaction that emits
// fails (SQLSTATE 55000, retried by workers, never dead-lettered) instead
// of writing events no slot holds, until SetUpWAL creates the slot again,
// which reports the loss.
func TestWALEmitRefusesWhileTheSlotIsGone(t *testing.T) {
	t.Parallel()
	f := newWALFixture(t)
	ctx := context.Background()
	f.emit(f.newRows([]string{"a"}, 3)) // pending: no relay reads the slot
	st, err := ReadWALState(ctx, f.db.Pool)
	if err != nil || st.LagBytes <= 0 {
		t.Fatalf("with 3 events unread the slot holds %d bytes (%v), want some", st.LagBytes, err)
	}
	if _, err := f.db.Pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, st.Slot); err != nil {
		t.Fatal(err)
	}
	relay, stop := f.startRelay(f.walConfig())
	defer stop()
	deadline := time.Now().Add(10 * time.Second)
	for !relay.Stats().WAL.SlotLost {
		if time.Now().After(deadline) {
			t.Fatal("the relay does not report the slot lost after 10s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	err = pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error { return Write(ctx, tx, ModeWAL, f.newRows([]string{"a"}, 1)) })
	if err == nil || !errors.Is(CheckWAL(ctx, f.db.Pool), ErrSlotLost) {
		t.Fatalf("an emit with the slot gone: %v; CheckWAL: %v", err, CheckWAL(ctx, f.db.Pool))
	}
	if st, _ := ReadWALState(ctx, f.db.Pool); !st.Lost() || st.LostAt.IsZero() {
		t.Errorf("state with the slot gone: %+v", st)
	}
	setup, err := SetUpWAL(ctx, f.db.Pool)
	if err != nil || !setup.Recreated || !setup.CreatedSlot {
		t.Fatalf("SetUpWAL after the loss: %+v, %v", setup, err)
	}
	rows := f.newRows([]string{"a"}, 2)
	f.emit(rows)
	f.waitDelivered(2, 30*time.Second)
	f.requireExactlyOnceInOrder(rows)
}

// TestSetUpWALNamesTheMissingReplicationPrivilege runs SetUpWAL as a role
// without REPLICATION: it fails and says so.
func TestSetUpWALNamesTheMissingReplicationPrivilege(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t, kfntest.NATSURL(t))
	ctx := context.Background()
	role, pool := f.roleWithoutReplication()
	_, err := SetUpWAL(ctx, pool)
	if err == nil || !containsAll(err.Error(), "lacks REPLICATION", `ALTER ROLE "`+role+`" REPLICATION`, "rds_replication") {
		t.Fatalf("SetUpWAL without REPLICATION: %v", err)
	}
}

func containsAll(s string, parts ...string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}

// TestSwitchingTableToWALAndBackLosesAndDuplicatesNothing writes events
// without pause while the writers switch from table to wal and back, and
// the relay is restarted in each mode (as a rolling restart does): every
// event reaches the stream once. The relay in either mode drains both the
// table and the slot, so the events of the mode being left are relayed.
func TestSwitchingTableToWALAndBackLosesAndDuplicatesNothing(t *testing.T) {
	t.Parallel()
	f := newWALFixture(t)
	var mu sync.Mutex
	mode := ModeTable
	var committed []Row
	// The writer stops between transactions (stopWriting), never inside
	// one: a commit cut short by a cancelled ctx may land unbeknown.
	ctx := context.Background()
	stopWriting := make(chan struct{})
	writerDone := make(chan error, 1)
	keys := keyNames("k", 10)
	go func() {
		for {
			select {
			case <-stopWriting:
				writerDone <- nil
				return
			default:
			}
			mu.Lock()
			m := mode
			mu.Unlock()
			rows := f.newRows(keys, 1)
			err := pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error { return Write(ctx, tx, m, rows) })
			if err != nil {
				writerDone <- fmt.Errorf("write in %s mode: %w", m, err)
				return
			}
			mu.Lock()
			committed = append(committed, rows...)
			mu.Unlock()
			time.Sleep(5 * time.Millisecond)
		}
	}()
	phase := func(m Mode, d time.Duration) {
		t.Helper()
		cfg := f.walConfig()
		cfg.Mode = m
		_, stop := f.startRelay(cfg)
		mu.Lock()
		mode = m
		mu.Unlock()
		time.Sleep(d)
		stop()
	}
	phase(ModeTable, 500*time.Millisecond)
	phase(ModeWAL, 700*time.Millisecond)
	phase(ModeTable, 700*time.Millisecond)
	close(stopWriting)
	if err := <-writerDone; err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	all := slices.Clone(committed)
	mu.Unlock()
	relay, stop := f.startRelay(f.config()) // table mode: it drains the slot too
	defer stop()
	f.waitDelivered(len(all), 30*time.Second)
	f.waitWALDrained(10 * time.Second)
	rep := checkDelivery(f.readStream(), all)
	if rep.lost+rep.duplicated+rep.unexpected != 0 {
		t.Fatalf("%d events committed across the switches: lost %d, duplicated %d, unexpected %d\n%s", len(all), rep.lost, rep.duplicated, rep.unexpected, strings.Join(rep.problems, "\n"))
	}
	t.Logf("%d events committed across table → wal → table, each once in the stream (%d keys out of order across a switch; the last relay published %d)", len(all), rep.reordered, relay.Stats().Published)
}

// TestWALRelayConfirmsNothingTheStreamHasNotAcked runs a relay whose
// publishes all fail for a while, so that it reads the slot's events and
// confirms positions (every StatusInterval) without any ack; then stops it
// and starts a working one: it must find every event still in the slot.
func TestWALRelayConfirmsNothingTheStreamHasNotAcked(t *testing.T) {
	t.Parallel()
	f := newWALFixture(t)
	var committed []Row
	for range 5 {
		rows := f.newRows(keyNames("k", 10), 2)
		f.emit(rows)
		committed = append(committed, rows...)
	}
	failing := f.walConfig()
	failing.publish = func(*nats.Conn, *nats.Msg) error { return nats.ErrConnectionClosed }
	r, stop := f.startRelay(failing)
	waitUntil(t, 10*time.Second, "the failing relay to read the events", func() bool { return r.Stats().WAL.Pending == int64(len(committed)) })
	time.Sleep(5 * failing.StatusInterval) // several confirmations
	stop()
	if st := r.Stats(); st.Published != 0 || st.Failures == 0 {
		t.Fatalf("the failing relay: %+v", st)
	}
	relay, stop2 := f.startRelay(f.walConfig())
	defer stop2()
	f.waitDelivered(len(committed), 30*time.Second)
	f.requireExactlyOnceInOrder(committed)
	requirePublishedOnce(t, relay, len(committed))
}

// TestWALRelayStoppedCleanlyLeavesNothingToPublishAgain relays events with
// a StatusInterval far longer than the run, stops the relay, and starts
// another: the first confirmed its position as it stopped, so the second
// publishes nothing again (after the stream's duplicate window, what it
// published again would be stored twice).
func TestWALRelayStoppedCleanlyLeavesNothingToPublishAgain(t *testing.T) {
	t.Parallel()
	f := newWALFixture(t)
	rows := f.newRows(keyNames("k", 10), 5)
	f.emit(rows)
	cfg := f.walConfig()
	cfg.StatusInterval = time.Hour
	_, stop := f.startRelay(cfg)
	f.waitDelivered(len(rows), 30*time.Second)
	stop()
	second, stop2 := f.startRelay(f.walConfig())
	defer stop2()
	f.waitWALDrained(10 * time.Second)
	if st := second.Stats(); st.Published+st.Duplicates != 0 {
		t.Errorf("the relay started after a clean stop published %d events again (%d acked as duplicates)", st.Published+st.Duplicates, st.Duplicates)
	}
	f.requireExactlyOnceInOrder(rows)
}
