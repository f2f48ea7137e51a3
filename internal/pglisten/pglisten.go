// Package pglisten keeps a Postgres LISTEN going for a process that also
// polls: it LISTENs on one channel on a connection of its own (not one of a
// pool's), hands on each notification's payload, and when the connection
// breaks it says so and connects again with backoff, until its ctx ends.
// Notifications sent while it was down are lost, so its users poll as
// well; it tells them when the LISTEN is in place again, so they can look
// for what committed meanwhile. The outbox relay (outbox.NotifyChannel)
// and the workers' dead letter retries (inbox.RetryNotifyChannel) use it.
package pglisten

import (
	"context"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
)

// Config says where to listen and what to do on each event. Every
// function is called from Run's goroutine, and must not block.
type Config struct {
	// Conn is the connection to open for the LISTEN (a pool's ConnConfig,
	// say; it is not changed).
	Conn *pgx.ConnConfig
	// Channel is the notification channel.
	Channel string
	// Backoff spaces the attempts to connect again. Run resets it when a
	// LISTEN is in place.
	Backoff backoff.BackOff
	// Notify is called with the payload of each notification.
	Notify func(payload string)
	// Listening, if set, is called each time the LISTEN is in place: the
	// first time, and after each reconnection.
	Listening func()
	// Lost, if set, is called when the connection broke (not when ctx
	// ended), with the error and how long Run waits before it connects
	// again.
	Lost func(err error, retryIn time.Duration)
}

// Run listens until ctx ends.
func Run(ctx context.Context, cfg Config) {
	for ctx.Err() == nil {
		err := listenOnce(ctx, cfg)
		if ctx.Err() != nil {
			return
		}
		delay := cfg.Backoff.NextBackOff()
		if cfg.Lost != nil {
			cfg.Lost(err, delay)
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}
}

// listenOnce connects, LISTENs and hands on notifications until the
// connection breaks or ctx ends.
func listenOnce(ctx context.Context, cfg Config) error {
	conn, err := pgx.ConnectConfig(ctx, cfg.Conn)
	if err != nil {
		return fmt.Errorf("connect to LISTEN: %w", err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		conn.Close(closeCtx) //nolint:errcheck // the connection is being dropped
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+cfg.Channel); err != nil {
		return fmt.Errorf("LISTEN %s: %w", cfg.Channel, err)
	}
	cfg.Backoff.Reset()
	if cfg.Listening != nil {
		cfg.Listening()
	}
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return fmt.Errorf("wait for %s notification: %w", cfg.Channel, err)
		}
		cfg.Notify(n.Payload)
	}
}
