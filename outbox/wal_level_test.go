package outbox

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestWALModeIsRefusedWithoutLogicalDecodingOrASlot checks what a worker
// in wal mode checks at start (CheckWAL) and what kfn migrate --outbox wal
// does first (SetUpWAL): a server with wal_level=replica is refused with
// the setting named, and a logical one without the slot set up too.
func TestWALModeIsRefusedWithoutLogicalDecodingOrASlot(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := ownPostgres(t, map[string]string{"wal_level": "replica"})
	for name, err := range map[string]error{"CheckWAL": CheckWAL(ctx, pool), "SetUpWAL": func() error { _, err := SetUpWAL(ctx, pool); return err }()} {
		if !errors.Is(err, ErrWALLevel) || !strings.Contains(err.Error(), "wal_level=replica") || !strings.Contains(err.Error(), "--outbox table") {
			t.Errorf("%s against wal_level=replica: %v", name, err)
		}
	}
	db := kfntest.Postgres(t) // wal_level=logical, migrated, no slot
	if err := CheckWAL(ctx, db.Pool); !errors.Is(err, ErrWALNotSetUp) {
		t.Errorf("CheckWAL without the slot set up: %v", err)
	}
	if _, err := SetUpWAL(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	if err := CheckWAL(ctx, db.Pool); err != nil {
		t.Errorf("CheckWAL once set up: %v", err)
	}
}
