package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/dlqtest"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// kfn dlq with a key parked (KeyOrder ParkKey): list selects key_parked
// letters, retry refuses one still behind its blocker, and discarding the
// blocker releases the key, saying so, with its parked letters marked for
// retry.
func TestDLQParkedKeyListRetryAndDiscard(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	kp := inbox.ReasonKeyParked
	ids := dlqtest.Seed(t, db.Pool,
		dlqtest.Letter{Function: "fa", Topic: "ta", Offset: 7, Reason: "permanent", Error: "permanent: bad amount", Age: time.Hour, Key: []byte("acct-1"), Value: []byte("v7")},
		dlqtest.Letter{Function: "fa", Topic: "ta", Offset: 9, Reason: kp, Error: inbox.KeyParkedError(7), Age: time.Hour, Key: []byte("acct-1"), Value: []byte("v9")},
		dlqtest.Letter{Function: "fa", Topic: "ta", Offset: 12, Reason: kp, Error: inbox.KeyParkedError(7), Age: time.Hour, Key: []byte("acct-1"), Value: []byte("v12")},
	)
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		return inbox.ParkKey(ctx, tx, inbox.Partition{Consumer: "fa", Topic: "ta", Partition: 0}, []byte("acct-1"), 7)
	})
	if err != nil {
		t.Fatal(err)
	}

	if got := listedIDs(t, db, "--reason", kp); !slices.Equal(got, ids[1:]) {
		t.Errorf("kfn dlq list --reason key_parked = %v, want %v", got, ids[1:])
	}
	code, out, stderr := kfn(t, "dlq", "list", "--database-url", db.URL, "--reason", kp)
	t.Logf("$ kfn dlq list --reason key_parked\n%s", out)
	if code != 0 || !strings.Contains(out, "key_parked") || !strings.Contains(out, "acct-1") || !strings.Contains(out, "key parked behind the dead letter at offset 7") {
		t.Errorf("kfn dlq list --reason key_parked: exit %d, out %q, err %q", code, out, stderr)
	}

	code, out, stderr = kfn(t, "dlq", "retry", "--database-url", db.URL, "--id", fmt.Sprint(ids[1]), "--reason", "too early")
	t.Logf("$ kfn dlq retry --id %d --reason \"too early\"\n%s%s", ids[1], out, stderr)
	want := fmt.Sprintf("refused %d (fa/ta/0@9): key_parked: its key is parked behind dead letter %d (offset 7)", ids[1], ids[0])
	if code != 1 || !strings.Contains(out, want) {
		t.Errorf("retry of a parked letter: exit %d, out %q, err %q; want exit 1 and %q", code, out, stderr, want)
	}

	code, out, stderr = kfn(t, "dlq", "discard", "--database-url", db.URL, fmt.Sprint(ids[0]), "--reason", "INC-4: amount fixed by hand")
	t.Logf("$ kfn dlq discard %d --reason \"INC-4: amount fixed by hand\"\n%s", ids[0], out)
	if code != 0 || !strings.Contains(out, "discarded 1 dead letter for good") ||
		!strings.Contains(out, "released key acct-1 of fa/ta/0 (parked behind offset 7): 2 parked records marked for retry, applied in offset order by its worker") {
		t.Errorf("discard of the blocker: exit %d, out %q, err %q", code, out, stderr)
	}
	if n := countRows(t, db, `SELECT count(*) FROM kfn.dead_letters WHERE reason = $1 AND retry_requested_at IS NOT NULL`, kp); n != 2 {
		t.Errorf("%d parked letters marked for retry, want 2", n)
	}
	if n := countRows(t, db, `SELECT count(*) FROM kfn.parked_keys`); n != 0 {
		t.Errorf("%d parked keys left, want none", n)
	}
	if audit := auditRows(t, db, inbox.ActionKeyReleased); len(audit) != 1 || !strings.Contains(audit[0], `"how": "discarded"`) {
		t.Errorf("key_released audit rows = %q", audit)
	}
}
