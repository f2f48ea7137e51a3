package engine

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/kfn-dev/kfn/internal/observe"
)

// This file bounds a handler call by --handler-timeout even when the
// handler ignores its ctx. Go cannot stop a goroutine, so the lane stops
// waiting for it instead: the handler runs in a goroutine of its own, and
// once it has overrun its deadline and a short grace, the lane abandons it.
// Abandoning ends the transaction's Postgres session (Postgres rolls the
// transaction back and releases its locks, whatever statement it was in)
// and closes its socket, hands the connection's pool slot back, and leaves
// the handler's goroutine to finish alone: the record is then dead-lettered
// with reason timeout in a new transaction, and the lane goes on. A handler
// still running after it was abandoned is counted
// (Stats.AbandonedHandlersRunning) and logged when it finally returns.

// abandonGrace is how long a handler past its deadline may take to return
// on its own (a handler that honours ctx returns within a round trip, as
// pgx cancels its statement) before the lane abandons it.
const abandonGrace = time.Second

// txConn is the connection a batch transaction runs on, acquired from the
// pool, so that an abandoned handler's connection can be taken out of the
// pool (Hijack) while the handler's goroutine still holds the transaction.
type txConn struct {
	pooled *pgxpool.Conn
	pid    uint32   // the server process of the session
	socket net.Conn // closed when the handler is abandoned
}

func acquireTxConn(ctx context.Context, pool *pgxpool.Pool) (*txConn, error) {
	c, err := pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	pg := c.Conn().PgConn()
	return &txConn{pooled: c, pid: pg.PID(), socket: pg.Conn()}, nil
}

// abandonedError is a handler call the lane stopped waiting for: its
// transaction's session was ended and its goroutine may still be running.
// The transaction must not be touched again: the goroutine still holds it.
type abandonedError struct{ err error }

func (e *abandonedError) Error() string {
	return fmt.Sprintf("%v (the handler did not return: it was abandoned and its transaction's session ended)", e.err)
}
func (e *abandonedError) Unwrap() error { return e.err }

func isAbandoned(err error) bool {
	var a *abandonedError
	return errors.As(err, &a)
}

// call runs one handler call on tx with the handler timeout, and turns a
// panic into an error. If the handler has not returned abandonGrace after
// its deadline (or after ctx ended), call abandons it and returns an
// *abandonedError.
func (a *applier) call(ctx context.Context, conn *txConn, handler func(context.Context) error) error {
	limit := a.cfg.HandlerTimeout
	hctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	started := time.Now()
	defer func() { a.stats.ObserveHandler(a.fn.Name, time.Since(started)) }()
	done := make(chan error, 1)
	go func() {
		defer func() {
			if v := recover(); v != nil {
				done <- &panicError{value: v, stack: debug.Stack()}
			}
		}()
		done <- handler(hctx)
	}()

	timedOut := func(err error) error {
		if errors.Is(hctx.Err(), context.DeadlineExceeded) && ctx.Err() == nil {
			return &timeoutError{limit: limit, err: err}
		}
		return err
	}
	select {
	case err := <-done:
		if err != nil {
			return timedOut(err)
		}
		return nil
	case <-hctx.Done():
	}
	grace := time.NewTimer(abandonGrace)
	defer grace.Stop()
	select {
	case err := <-done:
		if err == nil {
			// Returned nil after its deadline, probably without noticing it:
			// its work may be incomplete, and kfn cannot tell.
			err = hctx.Err()
		}
		return timedOut(err)
	case <-grace.C:
	}
	a.abandon(conn, done, started)
	return &abandonedError{err: timedOut(fmt.Errorf("handler still running %s after its deadline: %w", abandonGrace, hctx.Err()))}
}

// abandon ends the session of a handler that overran its deadline and
// leaves its goroutine to finish alone.
func (a *applier) abandon(conn *txConn, done <-chan error, started time.Time) {
	st := a.stats
	st.AbandonedHandlers.Add(1)
	st.AbandonedHandlersRunning.Add(1)
	st.CountFn(a.fn.Name, func(c *observe.FunctionCounters) { c.AbandonedHandlers++; c.AbandonedHandlersRunning++ })
	a.log.Error("handler overran --handler-timeout and ignored its ctx: abandoning it; its transaction's session is ended, and the handler keeps running until it returns",
		"handler_timeout", a.cfg.HandlerTimeout, "session_pid", conn.pid, "abandoned_handlers_running", st.AbandonedHandlersRunning.Load())

	// Ending the session rolls the transaction back and releases its locks
	// even if it is inside a long statement; closing the socket makes every
	// later call of the handler on the transaction fail at once. The pool
	// forgets the connection, so its slot is free again.
	endCtx, cancel := context.WithTimeout(context.Background(), observe.RoundTripLimit(a.cfg.StatementTimeout))
	defer cancel()
	if _, err := a.pool.Exec(endCtx, `SELECT pg_terminate_backend($1)`, conn.pid); err != nil {
		a.log.Warn("could not end the abandoned handler's session; closing its connection (Postgres rolls its transaction back once it notices)", "session_pid", conn.pid, "err", err)
	}
	conn.socket.Close()
	hijacked := conn.pooled.Hijack()

	go func() {
		err := <-done
		st.AbandonedHandlersRunning.Add(-1)
		st.CountFn(a.fn.Name, func(c *observe.FunctionCounters) { c.AbandonedHandlersRunning-- })
		hijacked.Close(context.Background()) //nolint:errcheck // its socket is closed already
		a.log.Warn("abandoned handler returned", "after", time.Since(started).Round(time.Millisecond), "err", err,
			"abandoned_handlers_running", st.AbandonedHandlersRunning.Load())
	}()
}

// isStatementTimeout reports whether err is Postgres cancelling a statement
// that ran longer than statement_timeout.
func isStatementTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "57014" && pgErr.Message == "canceling statement due to statement timeout"
}
