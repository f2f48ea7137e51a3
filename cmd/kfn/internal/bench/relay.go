package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/outbox"
)

// RelayConfig configures RunRelay.
type RelayConfig struct {
	// Pool is a migrated kfn database whose outbox is empty and not relayed
	// by anyone else. Give it at least Shards+4 connections.
	Pool *pgxpool.Pool
	// JetStream is where the benchmark streams are created (and deleted).
	JetStream jetstream.JetStream
	// Events is the backlog relayed for the throughput figures. Default 50000.
	Events int
	// Keys is how many event keys the backlog spreads over. Default 1000.
	Keys int
	// Modes are the outbox modes whose commit → ack latency is measured,
	// each with its own maximum rate. Default: ModeTable. ModeWAL needs
	// the WAL outbox set up in Pool's database (SetUpWAL); the relay of
	// every mode then reads the slot too, as a relay does there.
	Modes []outbox.Mode
	// Rate and Duration shape the latency runs: events committed per
	// second, in transactions of TxSize events by Committers sessions, with
	// the relay running. Rate 0 (the default) measures each mode's maximum
	// rate first (the same sessions committing as fast as they can for
	// Duration, with the relay running), then runs at 50% and at 80% of
	// it; a Rate runs each mode at that rate only. Defaults: 5s, 50, 4.
	Rate       int
	Duration   time.Duration
	TxSize     int
	Committers int
	// NaiveFor is how long the naive relay runs on the same backlog (it is
	// too slow to finish it). Default 5s.
	NaiveFor time.Duration
	// Relay overrides the relay's settings (Pool, JetStream, Stream and
	// Subjects are set by the benchmark).
	Relay outbox.RelayConfig
}

// RelayResult holds the figures of one RunRelay.
type RelayResult struct {
	Events         int
	RelayElapsed   time.Duration
	RelayPerSecond float64 // relay throughput on the backlog
	NaiveEvents    int
	NaiveElapsed   time.Duration
	NaivePerSecond float64 // one synchronous publish and one DELETE per row
	Ratio          float64 // RelayPerSecond / NaivePerSecond
	// RelayCost is the cost per event of relaying the backlog; LatencyCost
	// that of the latency run, which includes the committing sessions'
	// client side.
	RelayCost   EventCost
	LatencyCost EventCost
	// Latency is commit → ack with the relay running, for each of Modes.
	Latency []ModeLatency
}

// LatencyLoads are the shares of a mode's maximum rate its latency is
// measured at.
var LatencyLoads = []float64{0.5, 0.8}

// ModeLatency is one outbox mode's commit → ack latency.
type ModeLatency struct {
	Mode outbox.Mode
	// MaxRate is the events/s committed and acked when committing as fast
	// as possible (0 when RelayConfig.Rate was given).
	MaxRate float64
	Loads   []LoadLatency // at LatencyLoads of MaxRate, or at RelayConfig.Rate
}

// LoadLatency is one paced latency run.
type LoadLatency struct {
	Share   float64 // of the mode's MaxRate; 0 for RelayConfig.Rate
	Rate    int     // the rate asked for, events/s
	Reached float64 // events/s committed, over the time until the last ack
	Events  int
	// P50, P99 and Max are commit → stream ack, from sending COMMIT; the
	// Reply figures from the COMMIT's reply, when the events are visible
	// to the relay. CommitP50 and P99 are the COMMIT's own round trip (the
	// WAL flush of a durable commit), which the first includes and the
	// relay cannot shorten.
	P50, P99, Max        time.Duration
	ReplyP50, ReplyP99   time.Duration
	CommitP50, CommitP99 time.Duration
	Cost                 EventCost // relay and committers, per event
}

func (l LoadLatency) String() string {
	load := "asked"
	if l.Share > 0 {
		load = fmt.Sprintf("%.0f%% of the max rate", 100*l.Share)
	}
	r := func(d time.Duration) time.Duration { return d.Round(10 * time.Microsecond) }
	return fmt.Sprintf("commit→ack at %.0f events/s (%d/s, %s; %d events): p50 %v, p99 %v, max %v\n"+
		"  the COMMIT's own round trip (its WAL flush): p50 %v, p99 %v; from the COMMIT's reply to the ack: p50 %v, p99 %v\n"+
		"  cost (relay and committers): %s",
		l.Reached, l.Rate, load, l.Events, r(l.P50), r(l.P99), r(l.Max), r(l.CommitP50), r(l.CommitP99), r(l.ReplyP50), r(l.ReplyP99), l.Cost)
}

func (r RelayResult) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "relay: %d events in %v = %.0f events/s\n"+
		"relay cost on the backlog: %s\n"+
		"naive relay (sync publish + DELETE per row): %d events in %v = %.0f events/s\n"+
		"ratio relay/naive: %.1fx",
		r.Events, r.RelayElapsed.Round(time.Millisecond), r.RelayPerSecond,
		r.RelayCost,
		r.NaiveEvents, r.NaiveElapsed.Round(time.Millisecond), r.NaivePerSecond,
		r.Ratio)
	for _, m := range r.Latency {
		fmt.Fprintf(&b, "\n%s outbox: max rate committing and relaying: %.0f events/s", m.Mode, m.MaxRate)
		for _, l := range m.Loads {
			fmt.Fprintf(&b, "\n%s", l)
		}
	}
	return b.String()
}

func (c RelayConfig) withDefaults() RelayConfig {
	if c.Events == 0 {
		c.Events = 50000
	}
	if c.Keys == 0 {
		c.Keys = 1000
	}
	if c.Duration == 0 {
		c.Duration = 5 * time.Second
	}
	if c.Committers == 0 {
		c.Committers = 4
	}
	if c.TxSize == 0 {
		c.TxSize = 50
	}
	if len(c.Modes) == 0 {
		c.Modes = []outbox.Mode{outbox.ModeTable}
	}
	if c.NaiveFor == 0 {
		c.NaiveFor = 5 * time.Second
	}
	return c
}

// RunRelay measures, in one run and on one machine:
//   - the relay's throughput on a backlog of Events pre-inserted rows;
//   - a naive relay (one synchronous publish and one DELETE per row) on the
//     same backlog, and the ratio;
//   - for each of Modes, the maximum rate at which sessions commit events
//     with the relay running, and commit → stream ack latency (p50, p99,
//     max, with the COMMIT's own share) at steady rates of 50% and 80% of
//     it (or at Rate);
//   - the cost per event (CPU, allocations, syscalls) of every relay run.
//
// It uses streams of its own, deletes them afterwards, and leaves the outbox
// empty.
func RunRelay(ctx context.Context, cfg RelayConfig) (RelayResult, error) {
	cfg = cfg.withDefaults()
	if cfg.Pool == nil || cfg.JetStream == nil {
		return RelayResult{}, errors.New("relay benchmark: Pool and JetStream are required")
	}
	var n int
	if err := cfg.Pool.QueryRow(ctx, "SELECT count(*) FROM kfn.outbox").Scan(&n); err != nil {
		return RelayResult{}, fmt.Errorf("relay benchmark: %w", err)
	}
	if n != 0 {
		return RelayResult{}, fmt.Errorf("relay benchmark: the outbox holds %d rows; run it on an empty outbox", n)
	}
	res := RelayResult{Events: cfg.Events}
	bench := &relayBench{cfg: cfg, tag: fmt.Sprintf("kfnbench%d", time.Now().UnixNano()%1e9)}
	defer bench.cleanup()
	if err := bench.clearOutbox(ctx); err != nil { // the slot: past what an earlier relay read
		return res, err
	}

	// 1. Throughput on the backlog.
	rows := bench.rows("thr", cfg.Events)
	if err := bench.insert(ctx, rows, 1000); err != nil {
		return res, err
	}
	elapsed, cost, err := bench.relayBacklog(ctx, "THR", len(rows))
	if err != nil {
		return res, err
	}
	res.RelayElapsed, res.RelayPerSecond, res.RelayCost = elapsed, float64(len(rows))/elapsed.Seconds(), cost

	// 2. The naive relay on the same backlog, for NaiveFor.
	if err := bench.insert(ctx, rows, 1000); err != nil {
		return res, err
	}
	res.NaiveEvents, res.NaiveElapsed, err = bench.naiveRelay(ctx, "NAIVE")
	if err != nil {
		return res, err
	}
	res.NaivePerSecond = float64(res.NaiveEvents) / res.NaiveElapsed.Seconds()
	res.Ratio = res.RelayPerSecond / res.NaivePerSecond
	if _, err := cfg.Pool.Exec(ctx, "DELETE FROM kfn.outbox"); err != nil {
		return res, fmt.Errorf("relay benchmark: clear the naive relay's leftovers: %w", err)
	}

	// 3. Each mode's commit → ack latency.
	for _, mode := range cfg.Modes {
		m, err := bench.modeLatency(ctx, mode)
		if err != nil {
			return res, err
		}
		res.Latency = append(res.Latency, m)
	}
	return res, nil
}

// modeLatency measures mode's maximum rate, then its latency at each of
// LatencyLoads of it (or at cfg.Rate only), on a stream of its own.
func (b *relayBench) modeLatency(ctx context.Context, mode outbox.Mode) (ModeLatency, error) {
	res := ModeLatency{Mode: mode}
	stream, subject, err := b.stream(ctx, "LAT_"+strings.ToUpper(string(mode)))
	if err != nil {
		return res, err
	}
	type load struct {
		share float64
		rate  int
	}
	loads := []load{{rate: b.cfg.Rate}}
	if b.cfg.Rate == 0 {
		_, maxRate, _, err := b.latency(ctx, mode, stream, subject, 0)
		if err != nil {
			return res, fmt.Errorf("%s outbox, max rate: %w", mode, err)
		}
		res.MaxRate = maxRate
		loads = loads[:0]
		for _, share := range LatencyLoads {
			loads = append(loads, load{share: share, rate: max(1, int(share*maxRate))})
		}
	}
	for _, l := range loads {
		lat, reached, cost, err := b.latency(ctx, mode, stream, subject, l.rate)
		if err != nil {
			return res, fmt.Errorf("%s outbox at %d events/s: %w", mode, l.rate, err)
		}
		run := LoadLatency{Share: l.share, Rate: l.rate, Reached: reached, Events: len(lat.fromSend), Cost: cost}
		run.P50, run.P99, run.Max = percentiles(lat.fromSend)
		run.ReplyP50, run.ReplyP99, _ = percentiles(lat.fromReply)
		run.CommitP50, run.CommitP99, _ = percentiles(lat.commit)
		res.Loads = append(res.Loads, run)
	}
	return res, nil
}

// percentiles sorts d and returns its p50, p99 and maximum (zeros when
// empty).
func percentiles(d []time.Duration) (p50, p99, most time.Duration) {
	if len(d) == 0 {
		return 0, 0, 0
	}
	slices.Sort(d)
	return d[len(d)/2], d[len(d)*99/100], d[len(d)-1]
}

type relayBench struct {
	cfg     RelayConfig
	tag     string
	streams []string
	offset  atomic.Int64
}

func (b *relayBench) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, s := range b.streams {
		b.cfg.JetStream.DeleteStream(ctx, s) //nolint:errcheck // best effort
	}
}

func (b *relayBench) stream(ctx context.Context, name string) (string, string, error) {
	stream := strings.ToUpper(b.tag) + "_" + name
	subject := b.tag + "." + strings.ToLower(name)
	b.streams = append(b.streams, stream)
	_, err := b.cfg.JetStream.CreateStream(ctx, jetstream.StreamConfig{
		Name: stream, Subjects: []string{subject + ".>"}, Duplicates: 2 * time.Minute, Storage: jetstream.FileStorage,
	})
	if err != nil {
		return "", "", fmt.Errorf("relay benchmark: create stream: %w", err)
	}
	return stream, subject, nil
}

// rows makes n events over the configured keys, interleaved, with a
// 100-byte payload.
func (b *relayBench) rows(kind string, n int) []outbox.Row {
	payload := []byte(strings.Repeat("x", 100))
	rows := make([]outbox.Row, n)
	for i := range rows {
		offset := b.offset.Add(1)
		key := fmt.Sprintf("key-%d", i%b.cfg.Keys)
		origin := outbox.Origin{Consumer: "bench", Topic: "bench", Offset: offset, SourceID: outbox.KafkaSourceID("bench-"+kind+b.tag, 0, offset)}
		rows[i] = outbox.NewRow(origin, 0, key, outbox.Event{Subject: b.tag + ".SUBJECT.evt", Key: key, Data: payload})
	}
	return rows
}

func withSubject(rows []outbox.Row, subject string) []outbox.Row {
	out := slices.Clone(rows)
	for i := range out {
		out[i].Event.Subject = subject + ".evt"
	}
	return out
}

func (b *relayBench) insert(ctx context.Context, rows []outbox.Row, perTx int) error {
	for start := 0; start < len(rows); start += perTx {
		chunk := rows[start:min(start+perTx, len(rows))]
		if err := pgx.BeginFunc(ctx, b.cfg.Pool, func(tx pgx.Tx) error { return outbox.Insert(ctx, tx, chunk) }); err != nil {
			return fmt.Errorf("relay benchmark: insert: %w", err)
		}
	}
	return nil
}

func (b *relayBench) relayConfig(stream, subject string) outbox.RelayConfig {
	rc := b.cfg.Relay
	rc.Pool, rc.JetStream, rc.Stream, rc.Subjects = b.cfg.Pool, b.cfg.JetStream, stream, []string{subject + ".>"}
	return rc
}

// relayBacklog retargets the outbox rows to a fresh stream, runs the relay
// until the outbox is empty and returns how long that took and its cost.
func (b *relayBench) relayBacklog(ctx context.Context, name string, n int) (time.Duration, EventCost, error) {
	stream, subject, err := b.stream(ctx, name)
	if err != nil {
		return 0, EventCost{}, err
	}
	if _, err := b.cfg.Pool.Exec(ctx, "UPDATE kfn.outbox SET subject = $1", subject+".evt"); err != nil {
		return 0, EventCost{}, fmt.Errorf("relay benchmark: %w", err)
	}
	if _, err := b.cfg.Pool.Exec(ctx, "VACUUM ANALYZE kfn.outbox"); err != nil {
		return 0, EventCost{}, fmt.Errorf("relay benchmark: %w", err)
	}
	relay, err := outbox.NewRelay(b.relayConfig(stream, subject))
	if err != nil {
		return 0, EventCost{}, err
	}
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	cost := readProcessCost()
	start := time.Now()
	wg.Add(1)
	go func() {
		defer wg.Done()
		relay.Run(runCtx) //nolint:errcheck // the stream exists and fits
	}()
	defer func() { stop(); wg.Wait() }()
	for {
		if relay.Stats().Published+relay.Stats().Duplicates >= uint64(n) {
			var left int
			if err := b.cfg.Pool.QueryRow(ctx, "SELECT count(*) FROM kfn.outbox").Scan(&left); err != nil {
				return 0, EventCost{}, fmt.Errorf("relay benchmark: %w", err)
			}
			if left == 0 {
				return time.Since(start), cost.perEvent(n), nil
			}
		}
		if !sleep(ctx, 2*time.Millisecond) {
			return 0, EventCost{}, ctx.Err()
		}
	}
}

// naiveRelay is the baseline: read the oldest rows, then for each row one
// synchronous publish (waiting for its ack) and one DELETE.
func (b *relayBench) naiveRelay(ctx context.Context, name string) (int, time.Duration, error) {
	stream, subject, err := b.stream(ctx, name)
	if err != nil {
		return 0, 0, err
	}
	if _, err := b.cfg.Pool.Exec(ctx, "UPDATE kfn.outbox SET subject = $1", subject+".evt"); err != nil {
		return 0, 0, fmt.Errorf("relay benchmark: %w", err)
	}
	if _, err := b.cfg.Pool.Exec(ctx, "VACUUM ANALYZE kfn.outbox"); err != nil {
		return 0, 0, fmt.Errorf("relay benchmark: %w", err)
	}
	start := time.Now()
	done := 0
	for time.Since(start) < b.cfg.NaiveFor {
		batch, err := outbox.ReadPending(ctx, b.cfg.Pool, stream, 100)
		if err != nil {
			return 0, 0, fmt.Errorf("naive relay: %w", err)
		}
		if len(batch) == 0 {
			break
		}
		for i := range batch {
			if _, err := b.cfg.JetStream.PublishMsg(ctx, batch[i].Msg); err != nil {
				return 0, 0, fmt.Errorf("naive relay: publish: %w", err)
			}
			if _, err := b.cfg.Pool.Exec(ctx, "DELETE FROM kfn.outbox WHERE id = $1", batch[i].ID); err != nil {
				return 0, 0, fmt.Errorf("naive relay: delete: %w", err)
			}
			done++
			if time.Since(start) >= b.cfg.NaiveFor {
				break
			}
		}
	}
	return done, time.Since(start), nil
}

// latencies are a latency run's figures: per event, from sending its
// COMMIT and from the COMMIT's reply to its stream ack; per transaction,
// the COMMIT's round trip.
type latencies struct {
	fromSend, fromReply, commit []time.Duration
}

// relayCommit are when a transaction's COMMIT went out and when its reply
// came back.
type relayCommit struct{ sent, replied time.Time }

// latency commits rate events per second (0: as fast as it can) in mode
// for Duration with the relay running, from Committers sessions, to
// subject (captured by stream), and returns the latencies, the rate
// actually reached (events committed over the time until the last ack)
// and the cost per event.
func (b *relayBench) latency(ctx context.Context, mode outbox.Mode, stream, subject string, rate int) (latencies, float64, EventCost, error) {
	var lat latencies
	if err := b.clearOutbox(ctx); err != nil {
		return lat, 0, EventCost{}, err
	}
	var mu sync.Mutex
	committedAt := map[string]relayCommit{}
	ackedAt := map[string]time.Time{}
	rc := b.relayConfig(stream, subject)
	rc.Mode = mode
	rc.AfterAck = func(id string, at time.Time) {
		mu.Lock()
		ackedAt[id] = at
		mu.Unlock()
	}
	relay, err := outbox.NewRelay(rc)
	if err != nil {
		return lat, 0, EventCost{}, err
	}
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		relay.Run(runCtx) //nolint:errcheck // the stream exists and fits
	}()
	defer func() { stop(); wg.Wait() }()
	if err := b.relayReady(ctx, relay); err != nil {
		return lat, 0, EventCost{}, err
	}
	// One event through first: the clock starts with the path flowing (a
	// walsender just started decodes from the slot's restart point before
	// it streams, which a relay that runs all along has behind it).
	warm := withSubject(b.rows("warm", 1), subject)
	if _, err := b.commit(ctx, mode, warm); err != nil {
		return lat, 0, EventCost{}, fmt.Errorf("latency run: the first event: %w", err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		mu.Lock()
		_, ok := ackedAt[warm[0].EventID]
		mu.Unlock()
		if ok {
			break
		}
		if time.Now().After(deadline) {
			return lat, 0, EventCost{}, errors.New("latency run: the first event not acked 30s after its commit")
		}
		if !sleep(ctx, 2*time.Millisecond) {
			return lat, 0, EventCost{}, ctx.Err()
		}
	}
	mu.Lock()
	clear(ackedAt)
	mu.Unlock()

	// Each committer commits its share of the rate, one transaction every
	// interval (none: back to back), with rows made beforehand when paced:
	// at least one transaction each, however low the rate.
	var interval time.Duration
	txs := 0
	if rate > 0 {
		interval = time.Duration(float64(time.Second) * float64(b.cfg.TxSize*b.cfg.Committers) / float64(rate))
		txs = max(1, int(b.cfg.Duration/interval))
	}
	batches := make([][][]outbox.Row, b.cfg.Committers)
	for c := range batches {
		for range txs {
			batches[c] = append(batches[c], withSubject(b.rows("lat", b.cfg.TxSize), subject))
		}
	}
	cost := readProcessCost()
	start := time.Now()
	errs := make(chan error, b.cfg.Committers)
	var total atomic.Int64
	var commitWG sync.WaitGroup
	for c := range batches {
		commitWG.Add(1)
		go func() {
			defer commitWG.Done()
			offset := time.Duration(c) * interval / time.Duration(b.cfg.Committers)
			for i := 0; ; i++ {
				var rows []outbox.Row
				switch {
				case rate > 0 && i == len(batches[c]):
					return
				case rate > 0:
					rows = batches[c][i]
					if wait := time.Until(start.Add(offset + time.Duration(i)*interval)); wait > 0 {
						sleep(ctx, wait)
					}
				case time.Since(start) >= b.cfg.Duration:
					return
				default:
					rows = withSubject(b.rows("lat", b.cfg.TxSize), subject)
				}
				at, err := b.commit(ctx, mode, rows)
				if err != nil {
					errs <- fmt.Errorf("latency run: %w", err)
					return
				}
				mu.Lock()
				for _, r := range rows {
					committedAt[r.EventID] = at
				}
				lat.commit = append(lat.commit, at.replied.Sub(at.sent))
				mu.Unlock()
				total.Add(int64(len(rows)))
			}
		}()
	}
	commitWG.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return lat, 0, EventCost{}, err
	}
	// Every event committed is acked (an ack of anything else, which the
	// relay may read too, does not count).
	n := int(total.Load())
	allAcked := func() (acked int) {
		mu.Lock()
		defer mu.Unlock()
		if len(ackedAt) < n {
			return len(ackedAt)
		}
		for id := range committedAt {
			if _, ok := ackedAt[id]; ok {
				acked++
			}
		}
		return acked
	}
	deadline := time.Now().Add(30 * time.Second)
	for acked := allAcked(); acked < n; acked = allAcked() {
		if time.Now().After(deadline) {
			return lat, 0, EventCost{}, fmt.Errorf("latency run: only %d of %d events acked 30s after the last commit", acked, n)
		}
		if !sleep(ctx, 2*time.Millisecond) {
			return lat, 0, EventCost{}, ctx.Err()
		}
	}
	reached := float64(n) / time.Since(start).Seconds()
	spent := cost.perEvent(n)
	mu.Lock()
	defer mu.Unlock()
	lat.fromSend, lat.fromReply = make([]time.Duration, 0, n), make([]time.Duration, 0, n)
	for id, at := range committedAt {
		lat.fromSend = append(lat.fromSend, ackedAt[id].Sub(at.sent))
		lat.fromReply = append(lat.fromReply, ackedAt[id].Sub(at.replied))
	}
	return lat, reached, spent, nil
}

// clearOutbox starts a latency run on an empty outbox: it deletes the rows
// an earlier run's relay had acked and not deleted when it stopped (they
// would go to a stream that does not capture their subject now) and, with
// the WAL outbox set up, moves its slot past the events an earlier run
// read.
func (b *relayBench) clearOutbox(ctx context.Context) error {
	if _, err := b.cfg.Pool.Exec(ctx, "DELETE FROM kfn.outbox"); err != nil {
		return fmt.Errorf("relay benchmark: clear the outbox: %w", err)
	}
	if slices.Contains(b.cfg.Modes, outbox.ModeWAL) {
		return skipWAL(ctx, b.cfg.Pool)
	}
	return nil
}

// relayReady waits until the relay reaches its steady state: its LISTEN
// connection up and, with the WAL outbox set up, the slot's walsender
// streaming to it.
func (b *relayBench) relayReady(ctx context.Context, relay *outbox.Relay) error {
	wal := slices.Contains(b.cfg.Modes, outbox.ModeWAL)
	deadline := time.Now().Add(30 * time.Second)
	for {
		streaming := true
		if wal {
			err := b.cfg.Pool.QueryRow(ctx, `SELECT coalesce(bool_and(s.active), false)
  FROM kfn.wal_outbox w JOIN pg_replication_slots s ON s.slot_name = w.slot_name`).Scan(&streaming)
			if err != nil {
				return fmt.Errorf("relay benchmark: is the WAL outbox's slot read: %w", err)
			}
		}
		if relay.Stats().Listening && streaming {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("relay benchmark: the relay is not ready 30s after its start (listening %t, the slot read %t)", relay.Stats().Listening, streaming)
		}
		if !sleep(ctx, 5*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// commit writes rows in mode in one transaction and returns when its
// COMMIT went out and when the reply came.
func (b *relayBench) commit(ctx context.Context, mode outbox.Mode, rows []outbox.Row) (relayCommit, error) {
	tx, err := b.cfg.Pool.Begin(ctx)
	if err != nil {
		return relayCommit{}, err
	}
	if err := outbox.Write(ctx, tx, mode, rows); err != nil {
		tx.Rollback(ctx) //nolint:errcheck // the write's error is the one to report
		return relayCommit{}, err
	}
	at := relayCommit{sent: time.Now()}
	err = tx.Commit(ctx)
	at.replied = time.Now()
	return at, err
}

// sleep waits d or until ctx ends, and reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
