package lease_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/internal/lease"
)

// A Create that loses the race for a deleted key gets the server's "wrong
// last sequence" unmapped; on a replicated bucket (code 10164) it is not
// ErrKeyExists. Two kfn relays starting together on a 3-node cluster hit
// it on the stream lock and the loser exited (found by the chaos run).
func TestCreateConflictCoversTheUnmappedWrongLastSequence(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("create: %w", jetstream.ErrKeyExists), true},
		{fmt.Errorf("create: %w", &jetstream.APIError{Code: 400, ErrorCode: jetstream.JSErrCodeStreamWrongLastSequenceConstant, Description: "wrong last sequence"}), true},
		{&jetstream.APIError{Code: 400, ErrorCode: jetstream.JSErrCodeStreamWrongLastSequence, Description: "wrong last sequence: 7"}, true},
		{&jetstream.APIError{Code: 503, ErrorCode: jetstream.JSErrCodeJetStreamNotEnabled, Description: "jetstream not enabled"}, false},
		{errors.New("nats: timeout"), false},
		{nil, false},
	} {
		if got := lease.CreateConflict(c.err); got != c.want {
			t.Errorf("CreateConflict(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
