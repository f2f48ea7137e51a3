package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/pprof"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/kfn-dev/kfn/internal/repeatlog"
)

// Relay forwards committed outbox rows to a JetStream stream and deletes each
// row once the stream has acked it.
//
// The outbox is split into Shards shards by event key; one loop relays one
// shard, so all events of a key go through one loop, in order. Run works
// every shard in this process; RunShard works one, for a caller (such as a
// lease manager) that spreads shards over processes.
//
// Guarantees:
//   - Every committed row reaches the stream: a row is deleted only after its
//     stream ack, and the read has no cursor a late-committing row could fall
//     behind (see selectShardBatch). Rows of rolled-back transactions are
//     never visible, so never published.
//   - Each event is published with Nats-Msg-Id = its event id, so a
//     republish after a crash between ack and delete is dropped by the
//     stream's duplicate window.
//   - Per key, events reach the stream in the order their transactions
//     committed: a key has at most one publish in flight, and its next event
//     is sent only after the previous one is acked. A failed publish (a
//     reconnect between two events of a key, an ack timeout) is retried
//     before anything later of that key is sent, so no later event of the key
//     can already be in the stream. This holds across relays too: two
//     relays working one shard at once (a lease handover) each send a key's
//     events in order and only after the previous one is stored.
//
// Outages of NATS or Postgres are retried with exponential backoff; the relay
// does not give up while its context lives.
type Relay struct {
	cfg      RelayConfig
	log      *slog.Logger
	repeats  *repeatlog.Log // retried failures of its shards and loops, logged once per step
	wake     [Shards]chan struct{}
	counters relayCounters

	acksMu    sync.Mutex
	acks      *ackRouter // while shard loops run (acksUsers of them)
	acksUsers int

	streamMu       sync.Mutex
	streamSubjects []string // subjects the stream captures; nil until known
	// missedAt is when a subject was last looked up and found uncovered.
	missedAt map[string]time.Time
}

// NewRelay checks the configuration and returns a relay. It does not connect
// to anything; Run and RunShard do.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	r := &Relay{cfg: cfg, log: cfg.Logger.With("component", "outbox-relay", "stream", cfg.Stream), repeats: repeatlog.New()}
	for i := range r.wake {
		r.wake[i] = make(chan struct{}, 1)
	}
	return r, nil
}

// Run relays until ctx ends: every shard in this process, or, with
// RelayConfig.Scheduler, the shards it hands out. It wakes
// shards on Postgres notifications and polls as a fallback. It returns nil
// when ctx ends, and an error only for a problem retrying cannot fix (a
// *StreamMismatchError).
func (r *Relay) Run(ctx context.Context) error {
	if _, err := r.streamReady(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	var wg sync.WaitGroup
	defer wg.Wait() // runs after cancel below
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wg.Add(1)
	go func() {
		defer wg.Done()
		r.Listen(ctx)
	}()
	if r.readsSlot(ctx) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pprof.Do(ctx, profileLabels, r.runSlot)
		}()
	}
	if r.cfg.Scheduler != nil {
		return r.runScheduled(ctx)
	}
	errs := make(chan error, Shards)
	for shard := range Shards {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- r.RunShard(ctx, shard)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil && ctx.Err() == nil {
			return err
		}
	}
	return nil
}

// readsSlot reports whether Run reads the WAL outbox's slot: in wal mode,
// and in table mode when the WAL outbox is set up (events written before
// a switch back to table may be waiting in it).
func (r *Relay) readsSlot(ctx context.Context) bool {
	if r.cfg.Mode == ModeWAL {
		return true
	}
	state, err := ReadWALState(ctx, r.cfg.Pool)
	if err != nil {
		r.log.Warn("cannot tell whether the WAL outbox is set up; not reading its slot", "err", err)
		return false
	}
	return state.SetUp
}

// runScheduled works the shards the scheduler hands out.
func (r *Relay) runScheduled(ctx context.Context) error {
	work := func(ctx context.Context, shard int) {
		r.log.Debug("relaying shard", "shard", shard)
		if err := r.RunShard(ctx, shard); err != nil {
			r.log.Error("relay shard stopped", "shard", shard, "err", err)
		}
		r.log.Debug("stopped relaying shard", "shard", shard)
	}
	if err := r.cfg.Scheduler.Run(ctx, work); err != nil {
		return fmt.Errorf("relay shard scheduler: %w", err)
	}
	return nil
}

// RunShard relays one shard until ctx ends; cancelling ctx is how a lease
// manager takes the shard away. Only one loop per shard should run at a time
// in one process. It returns nil when ctx ends.
func (r *Relay) RunShard(ctx context.Context, shard int) error {
	if shard < 0 || shard >= Shards {
		return fmt.Errorf("relay shard %d: shards are 0 to %d", shard, Shards-1)
	}
	if _, err := r.streamReady(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	r.counters.activeShards.Add(1)
	defer r.counters.activeShards.Add(-1)
	pprof.Do(ctx, profileLabels, func(ctx context.Context) {
		if acks := r.takeAckRouter(ctx); acks != nil {
			defer r.releaseAckRouter()
			newShardLoop(r, shard, acks).run(ctx)
		}
	})
	return nil
}

// takeAckRouter returns the relay's ack router, making it when no shard
// loop runs, retrying with backoff while NATS refuses the subscription;
// nil when ctx ends first. A caller that got one gives it back with
// releaseAckRouter.
func (r *Relay) takeAckRouter(ctx context.Context) *ackRouter {
	r.acksMu.Lock()
	defer r.acksMu.Unlock()
	retry := r.newBackoff()
	for r.acks == nil {
		acks, err := newAckRouter(r.cfg.JetStream.Conn(), r.cfg.publish)
		if err == nil {
			r.acks = acks
			break
		}
		delay := retry.NextBackOff()
		r.repeats.Failed(ctx, r.log, slog.LevelWarn, acksNotTaken, "err", err, "retry_in", delay)
		if !sleepCtx(ctx, delay) {
			return nil
		}
	}
	r.repeats.Over(ctx, r.log, acksNotTaken)
	r.acksUsers++
	return r.acks
}

// releaseAckRouter closes the ack router when the last shard loop stops.
func (r *Relay) releaseAckRouter() {
	r.acksMu.Lock()
	defer r.acksMu.Unlock()
	if r.acksUsers--; r.acksUsers == 0 {
		r.acks.close()
		r.acks = nil
	}
}

// ProfileLabel is the pprof label (key and value) on the relay's goroutines
// (its shard loops, its LISTEN loop, and the NATS subscription that takes
// its acks, which the first shard loop starts): a CPU profile of a worker
// shows the relay's share with `go tool pprof -tagfocus kfn=relay`.
const (
	ProfileLabelKey   = "kfn"
	ProfileLabelValue = "relay"
)

var profileLabels = pprof.Labels(ProfileLabelKey, ProfileLabelValue)

// streamReady makes sure the stream exists, retrying outages with backoff,
// and returns its subjects.
func (r *Relay) streamReady(ctx context.Context) ([]string, error) {
	r.streamMu.Lock()
	defer r.streamMu.Unlock()
	if r.streamSubjects != nil {
		return r.streamSubjects, nil
	}
	retry := r.newBackoff()
	for {
		subjects, err := r.ensureStream(ctx)
		if err == nil {
			r.repeats.Over(ctx, r.log, streamNotAvailable)
			r.streamSubjects = subjects
			return subjects, nil
		}
		var mismatch *StreamMismatchError
		if errors.As(err, &mismatch) {
			r.log.Error("outbox stream does not fit the relay's configuration", "err", err)
			return nil, err
		}
		delay := retry.NextBackOff()
		r.repeats.Failed(ctx, r.log, slog.LevelWarn, streamNotAvailable, "err", err, "retry_in", delay)
		if !sleepCtx(ctx, delay) {
			return nil, ctx.Err()
		}
	}
}

// streamCovers reports whether the stream captures subject. When the cached
// subjects do not cover it, they are looked up again (at most every 5s or
// ParkFor), so an operator who widens the stream unblocks parked keys.
func (r *Relay) streamCovers(ctx context.Context, subject string) bool {
	r.streamMu.Lock()
	subjects := r.streamSubjects
	r.streamMu.Unlock()
	if CoversSubject(subjects, subject) {
		return true
	}
	r.streamMu.Lock()
	missedAt, missed := r.missedAt[subject]
	r.streamMu.Unlock()
	// A subject not looked up yet is looked up now: another function may
	// have added it to the stream since this relay read the subjects.
	if missed && time.Since(missedAt) < min(5*time.Second, r.cfg.ParkFor) {
		return false
	}
	lookupCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	stream, err := r.cfg.JetStream.Stream(lookupCtx, r.cfg.Stream)
	r.streamMu.Lock()
	defer r.streamMu.Unlock()
	if r.missedAt == nil || len(r.missedAt) > 1000 {
		r.missedAt = map[string]time.Time{}
	}
	if err == nil {
		r.streamSubjects = stream.CachedInfo().Config.Subjects
	}
	if err != nil || !CoversSubject(r.streamSubjects, subject) {
		r.missedAt[subject] = time.Now()
		return false
	}
	delete(r.missedAt, subject)
	return true
}

func (r *Relay) newBackoff() *backoff.ExponentialBackOff {
	b := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(r.cfg.RetryMin),
		backoff.WithMaxInterval(r.cfg.RetryMax),
		backoff.WithMaxElapsedTime(0), // never give up
	)
	b.Reset()
	return b
}

// sleepCtx waits for d or until ctx ends; it reports whether ctx is alive.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// The kinds of the relay's retried failures, logged through its repeats
// (package repeatlog): once per step of its schedule, however many shards
// fail alike, with their count.
const (
	acksNotTaken        = "cannot take stream acks yet; retrying"
	streamNotAvailable  = "outbox stream not available yet; retrying"
	readFailed          = "outbox read failed; retrying"
	publishFailed       = "outbox publish failed; pausing the shard"
	deleteWhileStopping = "could not delete relayed outbox rows while stopping; they will be republished and deduplicated"
	listenLost          = "outbox LISTEN connection lost; polling until it is back"
)
