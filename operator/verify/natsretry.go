package verify

import (
	"context"
	"errors"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// natsSettle bounds how long a JetStream API request is retried while it
// times out: right after a NATS node is lost, requests about a stream time
// out until the stream has a leader again, which takes seconds.
const natsSettle = 30 * time.Second

// retryNATS runs ask until it succeeds, fails for another reason than a
// JetStream request that went unanswered, or natsSettle has passed.
func retryNATS[T any](ctx context.Context, ask func() (T, error)) (T, error) {
	bo := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(100*time.Millisecond),
		backoff.WithMaxInterval(2*time.Second),
		backoff.WithMaxElapsedTime(natsSettle),
	)
	return backoff.RetryWithData(func() (T, error) {
		v, err := ask()
		if err != nil && !unanswered(err) {
			return v, backoff.Permanent(err)
		}
		return v, err
	}, backoff.WithContext(bo, ctx))
}

// unanswered reports whether err is a JetStream request that got no
// answer in time (no stream leader yet, no responder).
func unanswered(err error) bool {
	return errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders)
}
