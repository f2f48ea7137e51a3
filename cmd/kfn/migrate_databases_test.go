package main

import (
	"context"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/redact"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// TestMigrateCoversEveryFunctionsDatabase runs kfn migrate with
// --function-databases: it connects to every database before it changes
// any (an unreachable one leaves the others unmigrated), migrates
// --database-url's and each function's own once (a function sharing
// --database-url's is not migrated twice), names each, and a lease bucket
// it creates starts above the largest fence in any of them, not only in
// --database-url's.
func TestMigrateCoversEveryFunctionsDatabase(t *testing.T) {
	ctx := context.Background()
	dbA, dbB := kfntest.PostgresEmpty(t), kfntest.PostgresEmpty(t)

	unreachable := "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=2"
	code, _, stderr := kfn(t, "migrate", "--database-url", dbA.URL, "--function-databases", "b="+unreachable)
	if code != 1 || !strings.Contains(stderr, "cannot reach Postgres at postgres://postgres@127.0.0.1:1/postgres") {
		t.Fatalf("with b's database unreachable: exit %d, stderr %q; want exit 1 naming it", code, stderr)
	}
	if err := schema.Check(ctx, dbA.Pool); err == nil {
		t.Fatal("--database-url's database was migrated although b's could not be reached")
	}

	args := []string{"migrate", "--database-url", dbA.URL, "--function-databases", "b=" + dbB.URL + ",c=" + dbA.URL}
	code, out, stderr := kfn(t, args...)
	if code != 0 {
		t.Fatalf("kfn migrate: exit %d, out %q, err %q", code, out, stderr)
	}
	for _, db := range []*kfntest.PG{dbA, dbB} {
		if !strings.Contains(out, "kfn: database "+redact.Redact(db.URL)+"\n") {
			t.Errorf("the output does not name %s:\n%s", redact.Redact(db.URL), out)
		}
		if err := schema.Check(ctx, db.Pool); err != nil {
			t.Errorf("%s after kfn migrate: %v", redact.Redact(db.URL), err)
		}
	}
	if n := strings.Count(out, "applied migrations"); n != 2 {
		t.Errorf("migrations applied %d times; want twice (a and b, c shares a's database):\n%s", n, out)
	}

	// b's database holds a larger fence than a's: the bucket must start
	// above it.
	const bFence = 7_000_000_000
	for _, s := range []struct {
		db    *kfntest.PG
		epoch int64
	}{{dbA, 5}, {dbB, bFence}} {
		if _, err := s.db.Pool.Exec(ctx, `INSERT INTO kfn.cursors (consumer, topic, partition, next_offset, high_water, epoch, owner) VALUES ('f', 'src', 0, 0, 0, $1, 'w')`, s.epoch); err != nil {
			t.Fatal(err)
		}
	}
	natsURL := kfntest.NATSURL(t)
	bucket := kfntest.Name(t, "leases")
	code, out, stderr = kfn(t, append(args, "--nats", "--nats-url", natsURL, "--lease-bucket", bucket,
		"--event-stream", kfntest.Name(t, "EVENTS"), "--subjects", kfntest.Name(t, "ev")+".>")...)
	if code != 0 {
		t.Fatalf("kfn migrate --nats: exit %d, out %q, err %q", code, out, stderr)
	}
	if n := strings.Count(out, "schema is up to date"); n != 2 {
		t.Errorf("the second run found %d databases up to date; want 2:\n%s", n, out)
	}
	nc, js, err := connect.NATS(natsURL, "migrate-test")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	stream, err := js.Stream(ctx, "KV_"+bucket)
	if err != nil {
		t.Fatal(err)
	}
	if floor := stream.CachedInfo().Config.Metadata["kfn_token_floor"]; floor != "7000000000" {
		t.Errorf("the lease bucket's token floor is %q; want b's fence, 7000000000", floor)
	}
}
