package observe

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/lease"
	kfn "github.com/kfn-dev/kfn/runtime"
)

// This file is the worker's side of "no frozen connection can hold a lane":
// every Postgres round trip has a deadline, the sessions have server-side
// timeouts, connections use TCP keepalive, and a probe tells the lease
// managers whether this worker reaches Postgres at all. The timing is in
// package engine's documentation ("Postgres round trips, handler calls and the lease").

// LimitPostgres sets up the worker's pool for frozen connections:
//   - every round trip (statement, begin, commit, COPY, batch, prepare,
//     connect) gets a deadline of roundTripLimit(StatementTimeout), after
//     which pgx closes the connection: a frozen connection costs one round
//     trip, and the lane retries on another;
//   - the server cancels a statement after StatementTimeout
//     (statement_timeout), before the worker would close the connection, so
//     that a slow statement fails as itself; and it ends a session idle in a
//     transaction for longer than a handler call plus a round trip
//     (idle_in_transaction_session_timeout), which no live worker does, so
//     that a frozen or vanished worker's transaction does not hold its locks;
//   - both ends use TCP keepalive tied to the lease timing, so that a dead
//     peer is found without waiting for the kernel's defaults (hours).
//
// Settings given in the database URL win. health probes with a copy of the
// connection settings made here.
func LimitPostgres(pgCfg *pgxpool.Config, cfg kfn.Config, health *PGHealth) {
	defer func() { health.connCfg = pgCfg.ConnConfig.Copy() }()
	rt := RoundTripLimit(cfg.StatementTimeout)
	cc := pgCfg.ConnConfig
	cc.Tracer = &roundTrips{limit: rt, ok: health.succeeded}
	if cc.ConnectTimeout == 0 {
		cc.ConnectTimeout = rt
	}
	dialer := &net.Dialer{
		Timeout: cc.ConnectTimeout,
		KeepAliveConfig: net.KeepAliveConfig{
			Enable: true, Idle: cfg.LeaseTTL, Interval: cfg.LeaseRenew, Count: 3,
		},
	}
	cc.DialFunc = dialer.DialContext
	if pgCfg.PingTimeout == 0 {
		pgCfg.PingTimeout = rt
	}
	seconds := func(d time.Duration) string { return strconv.Itoa(max(1, int((d+time.Second-1)/time.Second))) }
	millis := func(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) }
	for name, value := range map[string]string{
		"statement_timeout":                   millis(cfg.StatementTimeout),
		"idle_in_transaction_session_timeout": millis(cfg.HandlerTimeout + rt),
		"tcp_keepalives_idle":                 seconds(cfg.LeaseTTL),
		"tcp_keepalives_interval":             seconds(cfg.LeaseRenew),
		"tcp_keepalives_count":                "3",
	} {
		if _, set := cc.RuntimeParams[name]; !set {
			cc.RuntimeParams[name] = value
		}
	}
}

// NoRoundTripLimit marks a ctx whose Postgres work may take as long as it
// needs (a function's Setup). Its statements run with statement_timeout 0.
func NoRoundTripLimit(ctx context.Context) context.Context {
	return context.WithValue(ctx, unlimitedKey{}, true)
}

type unlimitedKey struct{}

type cancelKey struct{}

// roundTrips is the pool's pgx tracer: it gives each round trip its
// deadline, and reports each one that succeeded to the health probe (any
// answer from Postgres shows that the worker reaches it).
type roundTrips struct {
	limit time.Duration
	ok    func()
}

// roundTripCounterKey marks a ctx whose round trips are counted, in the
// *atomic.Int64 it holds (Stats.BatchRoundTrips).
type roundTripCounterKey struct{}

// CountRoundTrips returns a ctx whose Postgres round trips are added to n.
func CountRoundTrips(ctx context.Context, n *atomic.Int64) context.Context {
	return context.WithValue(ctx, roundTripCounterKey{}, n)
}

// RoundTripLimit is how long a worker waits for one Postgres round trip
// before it takes the connection for frozen and closes it: 5/4 of the
// statement timeout, so that a slow statement is cancelled by the server
// first and fails as itself, with the connection intact.
func RoundTripLimit(statementTimeout time.Duration) time.Duration { return statementTimeout * 5 / 4 }

func (r *roundTrips) start(ctx context.Context) context.Context {
	if n, ok := ctx.Value(roundTripCounterKey{}).(*atomic.Int64); ok {
		n.Add(1)
	}
	if ctx.Value(unlimitedKey{}) != nil {
		return ctx
	}
	ctx, cancel := context.WithTimeout(ctx, r.limit)
	return context.WithValue(ctx, cancelKey{}, cancel)
}

func (r *roundTrips) end(ctx context.Context, err error) {
	if cancel, ok := ctx.Value(cancelKey{}).(context.CancelFunc); ok {
		cancel()
	}
	if err == nil {
		r.ok()
	}
}

func (r *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return r.start(ctx)
}

func (r *roundTrips) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	r.end(ctx, d.Err)
}

func (r *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return r.start(ctx)
}

func (r *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (r *roundTrips) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchEndData) {
	r.end(ctx, d.Err)
}

func (r *roundTrips) TraceCopyFromStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceCopyFromStartData) context.Context {
	return r.start(ctx)
}

func (r *roundTrips) TraceCopyFromEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceCopyFromEndData) {
	r.end(ctx, d.Err)
}

func (r *roundTrips) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	return r.start(ctx)
}

func (r *roundTrips) TracePrepareEnd(ctx context.Context, _ *pgx.Conn, d pgx.TracePrepareEndData) {
	r.end(ctx, d.Err)
}

func (r *roundTrips) TraceConnectStart(ctx context.Context, _ pgx.TraceConnectStartData) context.Context {
	return r.start(ctx)
}

func (r *roundTrips) TraceConnectEnd(ctx context.Context, d pgx.TraceConnectEndData) {
	r.end(ctx, d.Err)
}

// PGHealth tells whether this worker reaches Postgres. A probe on a
// connection of its own asks the server every LeaseRenew, with a timeout
// of LeaseRenew; every successful round trip of the pool counts as well.
// The worker is unhealthy once Postgres has not answered it for
// LeaseValidity − LeaseRenew since the first unanswered probe. Probes start
// every LeaseRenew, so a worker that loses Postgres is found out within the
// lease validity (0.7 × TTL) of the loss: the lease managers then release
// its leases and it acquires none (lease.Config.Healthy) until a probe
// succeeds again.
//
// A worker that was paused (SIGSTOP, a suspended VM) is not unhealthy on
// waking: only an unanswered probe makes it so. Its leases ran out while it
// slept, and the watchdog and the fence deal with those.
type PGHealth struct {
	connCfg *pgx.ConnConfig // for the probe's own connection
	every   time.Duration
	timeout time.Duration
	window  time.Duration
	log     *slog.Logger

	mu          sync.Mutex
	failingFrom time.Time // start of the first unanswered probe since the last answer; zero when answered
	lastErr     error
	lastOK      time.Time
}

func NewPGHealth(cfg kfn.Config) *PGHealth {
	return &PGHealth{
		every:   cfg.LeaseRenew,
		timeout: min(cfg.LeaseRenew, RoundTripLimit(cfg.StatementTimeout)),
		window:  lease.Validity(cfg.LeaseTTL) - cfg.LeaseRenew,
		log:     cfg.Logger,
		lastOK:  time.Now(),
	}
}

// succeeded records an answer from Postgres.
func (h *PGHealth) succeeded() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.failingFrom, h.lastErr, h.lastOK = time.Time{}, nil, time.Now()
}

// failed records a probe that started at start and got no answer.
func (h *PGHealth) failed(start time.Time, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.failingFrom.IsZero() {
		h.failingFrom = start
	}
	h.lastErr = err
}

// Healthy is the lease managers' health hook: nil while this worker
// reaches Postgres.
func (h *PGHealth) Healthy() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.failingFrom.IsZero() || time.Since(h.failingFrom) < h.window {
		return nil
	}
	return fmt.Errorf("postgres has not answered for %v (last answer %v ago): %w",
		time.Since(h.failingFrom).Round(time.Millisecond), time.Since(h.lastOK).Round(time.Millisecond), h.lastErr)
}

// run probes until ctx ends.
func (h *PGHealth) run(ctx context.Context) {
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
	}()
	t := time.NewTicker(h.every)
	defer t.Stop()
	wasHealthy := true
	for {
		start := time.Now()
		pctx, cancel := context.WithTimeout(ctx, h.timeout)
		err := h.probe(pctx, &conn)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			h.failed(start, err)
			if conn != nil {
				conn.Close(context.Background())
				conn = nil
			}
		} else {
			h.succeeded()
		}
		if healthy := h.Healthy() == nil; healthy != wasHealthy {
			if healthy {
				h.log.Info("postgres reachable again: taking leases again")
			} else {
				h.log.Warn("postgres unreachable: releasing every lease and taking none until it answers", "err", h.Healthy())
			}
			wasHealthy = healthy
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// probe asks the server for one round trip, connecting first if needed.
func (h *PGHealth) probe(ctx context.Context, conn **pgx.Conn) error {
	if *conn == nil {
		c, err := pgx.ConnectConfig(ctx, h.connCfg)
		if err != nil {
			return fmt.Errorf("probe: connect: %w", err)
		}
		*conn = c
	}
	var one int
	if err := (*conn).QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	if one != 1 {
		return errors.New("probe: SELECT 1 did not return 1")
	}
	return nil
}

// Start starts the probe and returns a function that stops it.
func (h *PGHealth) Start(ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.run(ctx)
	}()
	return func() {
		cancel()
		<-done
	}
}
