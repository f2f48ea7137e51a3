package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/outbox"
)

// dropWALOutbox retires the WAL outbox, waits up to wait for a relay to
// drain its slot (saying how far it is every progressEvery), and drops
// it (see outbox.RetireWAL). Without a relay reading the slot it says
// what to start and fails after wait, keeping the retirement.
func dropWALOutbox(ctx context.Context, pool *pgxpool.Pool, wait, progressEvery time.Duration, stdout io.Writer) error {
	deadline := time.Now().Add(wait)
	state, err := outbox.RetireWAL(ctx, pool, wait)
	if errors.Is(err, outbox.ErrWALNotSetUp) {
		fmt.Fprintln(stdout, "kfn: WAL outbox: not set up in this database; nothing to drop")
		return nil
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "kfn: WAL outbox: retired at %s: emits into the WAL are refused from then on (workers still in wal mode retry until restarted with --outbox table)\n",
		state.RetiredAt.UTC().Format(time.RFC3339))
	warnedIdle := false
	for next := time.Now(); !state.Drained(); {
		if !time.Now().Before(next) {
			fmt.Fprintln(stdout, drainProgress(state))
			next = time.Now().Add(progressEvery)
		}
		if state.ActivePID == 0 && !warnedIdle {
			fmt.Fprintf(stdout, "kfn: WAL outbox: no relay reads the slot %s: start `kfn relay` (or a worker with its relay on, in either outbox mode) against this database; it relays what the slot holds\n", state.Slot)
			warnedIdle = true
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w after %s (%d bytes of WAL from before the retirement left; %s): the retirement is kept; start a relay and run `kfn migrate --drop-wal-outbox` again",
				outbox.ErrWALNotDrained, wait, state.RetireLeftBytes, drainReader(state))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
		if state, err = outbox.ReadWALState(ctx, pool); err != nil {
			return err
		}
		if !state.SetUp {
			fmt.Fprintln(stdout, "kfn: WAL outbox: dropped meanwhile (by another run)")
			return nil
		}
	}
	fmt.Fprintf(stdout, "kfn: WAL outbox: drained: every event emitted before the retirement is acked by the stream\n")
	dropped, err := outbox.DropRetiredWAL(ctx, pool)
	if errors.Is(err, outbox.ErrWALNotSetUp) {
		fmt.Fprintln(stdout, "kfn: WAL outbox: dropped meanwhile (by another run)")
		return nil
	}
	if err != nil {
		return fmt.Errorf("drop the WAL outbox: %w", err)
	}
	if dropped.Terminated != 0 {
		fmt.Fprintf(stdout, "kfn: WAL outbox: ended the relay's walsender (pid %d) on the slot\n", dropped.Terminated)
	}
	slot := "dropped"
	if !dropped.SlotDropped {
		slot = "was gone already"
	}
	fmt.Fprintf(stdout, "kfn: WAL outbox: replication slot %s %s, publication %s dropped; `kfn migrate --outbox wal` would set it up afresh\n", dropped.Slot, slot, dropped.Publication)
	return nil
}

// drainProgress says how much of the retired slot is left to relay.
func drainProgress(s outbox.WALState) string {
	return fmt.Sprintf("kfn: WAL outbox: draining the slot %s: %d bytes of WAL from before the retirement left, %d events read and not yet acked; %s",
		s.Slot, max(s.RetireLeftBytes, 0), s.Pending, drainReader(s))
}

func drainReader(s outbox.WALState) string {
	if s.ActivePID == 0 {
		return "no relay reads it"
	}
	reader := s.Reader
	if reader == "" {
		reader = "a relay"
	}
	return fmt.Sprintf("read by %s (walsender pid %d)", reader, s.ActivePID)
}
