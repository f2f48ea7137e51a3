//go:build container

package kubeplay

import (
	"context"
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// roleURLs reads, from the rewritten Secrets, the URL each rendered role
// connects with: the migrator's (Secret kfn-migrator) and the others by
// their role name.
func roleURLs(t *testing.T, p played) (migrator string, roles map[string]string) {
	t.Helper()
	roles = map[string]string{}
	for name, values := range p.secrets {
		u, err := url.Parse(values["url"])
		if err != nil || u.User == nil {
			continue
		}
		if strings.HasPrefix(name, "kfn-migrator") {
			migrator = u.String()
		}
		roles[u.User.Username()] = u.String()
	}
	if migrator == "" {
		t.Fatalf("no kfn-migrator Secret with a database URL among %v", slices.Sorted(maps.Keys(p.secrets)))
	}
	return migrator, roles
}

// prepareDatabase does what docs/production/postgres.md asks before the
// first rollout, with the images this run built: as a superuser, the
// roles the Secrets name and the migrator's schema rights ("Three
// roles"); as the migrator, kfn's migrations and each function's
// (`kfn migrate`, `orders migrate`, `ledger migrate`); then each role's
// grants and binding (`kfn migrate grants --apply`, "One role per
// function"). The pods' init containers migrate again when they start:
// idempotent.
func prepareDatabase(t *testing.T, pm *podman, pg *kfntest.PG, p played, images map[string]string) {
	t.Helper()
	ctx := context.Background()
	migrator, roles := roleURLs(t, p)
	mu, _ := url.Parse(migrator)
	db := pgx.Identifier{pg.Database}.Sanitize()
	var sql []string
	for _, name := range slices.Sorted(maps.Keys(roles)) {
		u, _ := url.Parse(roles[name])
		password, _ := u.User.Password()
		// Roles are the server's, not the database's: a shared server
		// (KFN_TEST_DATABASE_URL) may have them from an earlier run.
		sql = append(sql, fmt.Sprintf(`DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = %[1]s) THEN CREATE ROLE %[2]s LOGIN PASSWORD %[3]s; END IF;
END $$`, quote(name), pgx.Identifier{name}.Sanitize(), quote(password)))
	}
	m := pgx.Identifier{mu.User.Username()}.Sanitize()
	sql = append(sql,
		"GRANT CREATE ON DATABASE "+db+" TO "+m,
		"CREATE SCHEMA kfn AUTHORIZATION "+m,
		"GRANT USAGE, CREATE ON SCHEMA public TO "+m)
	for _, s := range sql {
		if _, err := pg.Pool.Exec(ctx, s); err != nil {
			t.Fatalf("as the superuser: %s: %v", s, err)
		}
	}
	steps := [][]string{
		{images["ghcr.io/kfn-dev/kfn"], "migrate"},
		{images["ghcr.io/kfn-dev/kfn-orders"], "migrate"},
		{images["ghcr.io/kfn-dev/kfn-ledger"], "migrate"},
	}
	for _, g := range [][]string{
		{"--function", "orders", "--role", "kfn_fn_orders", "--tables", "orders"},
		{"--function", "ledger", "--role", "kfn_fn_ledger", "--tables", "ledger_entries"},
		{"--function", "*", "--role", "kfn_relay"},
	} {
		if _, ok := roles[g[3]]; !ok {
			t.Fatalf("no Secret connects as %s, which docs/production/postgres.md binds", g[3])
		}
		steps = append(steps, append([]string{images["ghcr.io/kfn-dev/kfn"], "migrate", "grants", "--apply"}, g...))
	}
	for i, s := range steps {
		name := fmt.Sprintf("kfn-kubeplay-%s-step%d", pm.run, i)
		pm.willRun(nil, []string{name})
		start := time.Now()
		args := append([]string{"run", "--rm", "--name", name, "--network", "host", "-e", "DATABASE_URL=" + migrator}, s...)
		out, err := pm.Command(args...).CombinedOutput()
		if err != nil {
			t.Fatalf("podman run %s: %v\n%s", strings.Join(s, " "), err, out)
		}
		t.Logf("as the migrator, %s (%s)", strings.Join(s, " "), time.Since(start).Round(time.Millisecond))
	}
}

func quote(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// cursor is one partition's row of kfn.cursors.
type cursor struct {
	partition int
	owner     string
	epoch     int64
	claimedAt time.Time
	committed bool // updated since its claim
}

func cursors(t *testing.T, pg *kfntest.PG, consumer, topic string) []cursor {
	t.Helper()
	rows, err := pg.Pool.Query(context.Background(),
		`SELECT partition, owner, epoch, claimed_at, updated_at > claimed_at FROM kfn.cursors WHERE consumer = $1 AND topic = $2 ORDER BY partition`, consumer, topic)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (cursor, error) {
		var c cursor
		return c, r.Scan(&c.partition, &c.owner, &c.epoch, &c.claimedAt, &c.committed)
	})
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

func ownedBy(cs []cursor, owner string) []cursor {
	return slices.DeleteFunc(slices.Clone(cs), func(c cursor) bool { return c.owner != owner })
}

// waitOwners waits until the live workers own every partition, none more
// than its share, each having committed since its claim.
func waitOwners(t *testing.T, pg *kfntest.PG, topic string, partitions int, live []string, limit time.Duration) {
	t.Helper()
	share := (partitions + len(live) - 1) / len(live)
	kfntest.Await(t, limit, fmt.Sprintf("%v to own the %d partitions, balanced, each committed on", live, partitions), func() (bool, string) {
		cs := cursors(t, pg, "orders", topic)
		count := map[string]int{}
		for _, c := range cs {
			if !slices.Contains(live, c.owner) || !c.committed {
				return false, fmt.Sprintf("partition %d: owner %s, committed since its claim: %v", c.partition, c.owner, c.committed)
			}
			count[c.owner]++
		}
		for id, n := range count {
			if n > share {
				return false, fmt.Sprintf("%s owns %d partitions, more than its share %d", id, n, share)
			}
		}
		return len(cs) == partitions, fmt.Sprintf("%d of %d partitions have a cursor", len(cs), partitions)
	})
}

// handover is what became of one partition when its owner went away.
type handover struct {
	partition      int
	claimedAt      time.Time // the new owner's claim
	newOwner       string
	lastOld        time.Time // the earlier terms' last batch (its transaction's start)
	firstNew       time.Time // the new term's first
	lastOffsetOld  int64
	firstOffsetNew int64
}

// handovers waits until every partition of before has a new term (a
// larger epoch) under one of live, committed on, and reads what the inbox
// says about the two terms' batches.
func handovers(t *testing.T, pg *kfntest.PG, topic string, before []cursor, live []string, limit time.Duration, what string) []handover {
	t.Helper()
	var hs []handover
	kfntest.Await(t, limit, what, func() (bool, string) {
		now := map[int]cursor{}
		for _, c := range cursors(t, pg, "orders", topic) {
			now[c.partition] = c
		}
		hs = hs[:0]
		for _, old := range before {
			c := now[old.partition]
			if c.epoch <= old.epoch || !slices.Contains(live, c.owner) || !c.committed {
				return false, fmt.Sprintf("partition %d: owner %s, epoch %d (was %d), committed since its claim: %v", old.partition, c.owner, c.epoch, old.epoch, c.committed)
			}
			h := handover{partition: old.partition, claimedAt: c.claimedAt, newOwner: c.owner}
			var lastOld, firstNew *time.Time
			var lastOffsetOld, firstOffsetNew *int64
			err := pg.Pool.QueryRow(context.Background(), `
SELECT (SELECT max(i.processed_at) FROM kfn.inbox i JOIN kfn.lanes l ON l.id = i.lane WHERE l.consumer = 'orders' AND l.topic = $1 AND l.partition = $2 AND i.epoch < $3),
       (SELECT max(i."offset") FROM kfn.inbox i JOIN kfn.lanes l ON l.id = i.lane WHERE l.consumer = 'orders' AND l.topic = $1 AND l.partition = $2 AND i.epoch < $3),
       (SELECT min(i.processed_at) FROM kfn.inbox i JOIN kfn.lanes l ON l.id = i.lane WHERE l.consumer = 'orders' AND l.topic = $1 AND l.partition = $2 AND i.epoch = $3),
       (SELECT min(i."offset") FROM kfn.inbox i JOIN kfn.lanes l ON l.id = i.lane WHERE l.consumer = 'orders' AND l.topic = $1 AND l.partition = $2 AND i.epoch = $3)`,
				topic, old.partition, c.epoch).Scan(&lastOld, &lastOffsetOld, &firstNew, &firstOffsetNew)
			if err != nil {
				return false, fmt.Sprintf("partition %d: the inbox around epoch %d: %v", old.partition, c.epoch, err)
			}
			if firstNew == nil {
				return false, fmt.Sprintf("partition %d: no record applied under the new epoch %d yet", old.partition, c.epoch)
			}
			h.firstNew, h.firstOffsetNew = *firstNew, *firstOffsetNew
			h.lastOffsetOld = -1 // no earlier term applied anything
			if lastOld != nil {
				h.lastOld, h.lastOffsetOld = *lastOld, *lastOffsetOld
			}
			hs = append(hs, h)
		}
		return true, ""
	})
	return hs
}

// count runs a count query.
func count(t *testing.T, pg *kfntest.PG, query string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := pg.Pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}
