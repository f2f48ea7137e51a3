package schema_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// The statements of workers built for schema 11 that write kfn.inbox,
// besides the batch's fence and claim (fenceAndClaimSchema11), as they were
// in inbox/*.go before migration 0012 (git show 992b413^:inbox/inbox.go,
// retry.go, replay.go); the DELETEs return what they deleted, for the
// test's bookkeeping.
const (
	// inbox.MarkDeadLettered: an UPDATE when the record's row is there.
	markDeadLetteredSchema11 = `
INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch, outcome) VALUES ($1, $2, $3, $4, $5, 'dead_lettered')
ON CONFLICT (consumer, topic, partition, "offset") DO UPDATE SET outcome = 'dead_lettered'`
	// inbox.MarkRetryApplied: a retried dead letter's row becomes applied.
	markRetryAppliedSchema11 = `
INSERT INTO kfn.inbox AS i (consumer, topic, partition, "offset", epoch, outcome) VALUES ($1, $2, $3, $4, $5, 'applied')
ON CONFLICT (consumer, topic, partition, "offset") DO UPDATE SET outcome = 'applied', epoch = EXCLUDED.epoch, processed_at = now()
 WHERE i.outcome = 'dead_lettered'`
	// inbox.Purge, one partition's head: retention.
	purgeHeadSchema11 = `
DELETE FROM kfn.inbox i
 USING (SELECT "offset",
               bool_or(processed_at >= now() - $5::interval
                       OR "offset" >= (SELECT high_water FROM kfn.cursors c
                                        WHERE c.consumer = $1 AND c.topic = $2 AND c.partition = $3))
                 OVER (ORDER BY "offset") AS stays -- this row or an earlier one stays
          FROM (SELECT "offset", processed_at FROM kfn.inbox
                 WHERE consumer = $1 AND topic = $2 AND partition = $3
                 ORDER BY "offset" LIMIT $4) head) old
 WHERE NOT old.stays AND i.consumer = $1 AND i.topic = $2 AND i.partition = $3 AND i."offset" = old."offset"
RETURNING i."offset"`
	// inbox.Replay with re-execution: the released rows.
	releaseSchema11 = `DELETE FROM kfn.inbox WHERE consumer = $1 AND topic = $2 AND partition = $3 AND "offset" >= $4 AND "offset" < $5
RETURNING "offset"`
)

// Names a function or a subject can have: the old inbox's text columns
// hold any character but NUL (and Postgres refuses invalid UTF-8), in
// whatever order the database's collation sorts them.
var (
	oldConsumers = []string{"orders", "Orders", "ünïcødé ƒn", `quote'"\`, "ctl\x01\t\nx", "emoji🧨", "%_*", "z\u200f"}
	oldTopics    = []string{"t", "subj.>", " lead space"}
)

const oldPartitions = 4

// oldInbox is a database at schema 11 whose inbox holds perPartition rows
// (offsets from 0) in each of
// len(oldConsumers)×len(oldTopics)×oldPartitions partitions, and the role
// of its workers.
type oldInbox struct {
	db           *kfntest.PG
	worker       *pgxpool.Pool // the old installation's workers' role: bound to every function, granted on kfn.inbox and kfn.cursors only
	acl          []string      // kfn.inbox's grants
	perPartition int64
}

// highWater is the cursors' high-water mark.
func (old oldInbox) highWater() int64 { return old.perPartition - 100 }

// seedOldInbox makes an oldInbox. Every (consumer, topic, partition) has
// its rows; the cursors' high-water marks are 100 below the last offset,
// so the last 100 rows of each partition block offsets a re-execution
// left above it. Every 97th row is dead-lettered. The consumers at odd
// positions have no cursor for partition 3: their lanes come from the
// inbox rows alone.
func seedOldInbox(t *testing.T, perPartition int64) oldInbox {
	t.Helper()
	ctx := context.Background()
	db := kfntest.PostgresEmpty(t)
	if _, err := schema.MigrateTo(ctx, db.Pool, 11); err != nil {
		t.Fatal(err)
	}
	role := newRole(t, db.Pool, "v11_worker")
	quoted := pgx.Identifier{role}.Sanitize()
	for _, sql := range []string{
		`GRANT USAGE ON SCHEMA kfn TO ` + quoted,
		`GRANT SELECT ON kfn.installation, kfn.schema_migrations TO ` + quoted,
		`GRANT SELECT, INSERT, UPDATE, DELETE ON kfn.cursors, kfn.inbox TO ` + quoted,
		`INSERT INTO kfn.function_roles (role_name, consumer) VALUES ('` + role + `', '*')`,
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	_, err := db.Pool.Exec(ctx, `
INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch, outcome, processed_at)
SELECT c, tp, p, o, 1 + o % 3, CASE WHEN o % 97 = 0 THEN 'dead_lettered' ELSE 'applied' END,
       now() - interval '2 days' + o * interval '1 ms'
  FROM unnest($1::text[]) AS c, unnest($2::text[]) AS tp, generate_series(0, $3 - 1) AS p, generate_series(0, $4 - 1) AS o`,
		oldConsumers, oldTopics, oldPartitions, perPartition)
	if err != nil {
		t.Fatal(err)
	}
	_, err = db.Pool.Exec(ctx, `
INSERT INTO kfn.cursors (consumer, topic, partition, next_offset, high_water, epoch, owner)
SELECT c.c, tp, p, $4, $4, 3, 'old'
  FROM unnest($1::text[]) WITH ORDINALITY AS c(c, n), unnest($2::text[]) AS tp, generate_series(0, $3 - 1) AS p
 WHERE c.n % 2 = 1 OR p < 3`, oldConsumers, oldTopics, oldPartitions, perPartition-100)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `ANALYZE kfn.inbox`); err != nil {
		t.Fatal(err)
	}
	return oldInbox{db: db, worker: poolAs(t, db.URL, role), acl: tableACL(t, db.Pool, "kfn.inbox"), perPartition: perPartition}
}

// The inbox's rows as text, in one order, so that two inboxes compare:
// the old table's, and the new one's through its lanes.
const (
	oldRowsSQL = `SELECT coalesce(array_agg(format('%s/%s/%s@%s epoch %s %s %s', consumer, topic, partition, "offset", epoch, outcome, processed_at)
	                                   ORDER BY consumer COLLATE "C", topic COLLATE "C", partition, "offset"), '{}') FROM kfn.inbox`
	newRowsSQL = `SELECT coalesce(array_agg(format('%s/%s/%s@%s epoch %s %s %s', consumer, topic, partition, "offset", epoch, outcome, processed_at)
	                                   ORDER BY consumer COLLATE "C", topic COLLATE "C", partition, "offset"), '{}') FROM kfn.inbox JOIN kfn.lanes ON id = lane`
	oldLanesSQL = `SELECT array_agg(format('%s/%s/%s', consumer, topic, partition) ORDER BY 1) FROM (
	                 SELECT consumer, topic, partition FROM kfn.cursors UNION SELECT consumer, topic, partition FROM kfn.inbox) p`
	newLanesSQL = `SELECT array_agg(format('%s/%s/%s', consumer, topic, partition) ORDER BY 1), count(DISTINCT id) FROM kfn.lanes`
)

func rowsOf(t *testing.T, pool *pgxpool.Pool, sql string) []string {
	t.Helper()
	var rows []string
	if err := pool.QueryRow(context.Background(), sql).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	return rows
}

// tableACL lists table's grants to other roles than its owner.
func tableACL(t *testing.T, pool *pgxpool.Pool, table string) []string {
	t.Helper()
	var acl []string
	err := pool.QueryRow(context.Background(), `
SELECT coalesce(array_agg(format('%s %s', CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE pg_get_userbyid(a.grantee) END, a.privilege_type) ORDER BY 1), '{}')
  FROM pg_class c, aclexplode(c.relacl) a WHERE c.oid = $1::regclass AND a.grantee <> c.relowner`, table).Scan(&acl)
	if err != nil {
		t.Fatal(err)
	}
	return acl
}

// oldWriter acts as a worker built for schema 11 on an oldInbox, through
// that worker's own statements, until stopped: it claims batches of new
// offsets on its partition, dead-letters rows, applies retried dead
// letters, purges partitions' heads (retention) and releases ranges for
// a re-execution, spread over the whole inbox and over its own fresh rows.
// It keeps, as its model, every row it knows of: the seeded ones and the
// effects of its committed writes.
type oldWriter struct {
	old   oldInbox
	pool  *pgxpool.Pool
	rng   *rand.Rand
	next  int64 // its partition's next offset
	model map[string]string

	mu  sync.Mutex
	ops []writerOp
}

type writerOp struct {
	kind       string
	start, end time.Time
}

// writerPartition is the partition the old writer claims records of: one
// of the seeded ones, so its head is old rows.
var writerPartition = inbox.Partition{Consumer: oldConsumers[0], Topic: oldTopics[0], Partition: 1}

func newOldWriter(old oldInbox) *oldWriter {
	w := &oldWriter{old: old, pool: old.worker, rng: rand.New(rand.NewPCG(12, 12)), next: old.highWater(), model: map[string]string{}}
	for _, c := range oldConsumers {
		for _, tp := range oldTopics {
			for p := range int32(oldPartitions) {
				for o := range old.perPartition {
					outcome := "applied"
					if o%97 == 0 {
						outcome = "dead_lettered"
					}
					w.model[modelKey(c, tp, p, o)] = fmt.Sprintf("epoch %d %s", 1+o%3, outcome)
				}
			}
		}
	}
	return w
}

func modelKey(consumer, topic string, partition int32, offset int64) string {
	return fmt.Sprintf("%s/%s/%d@%d", consumer, topic, partition, offset)
}

// run writes until stop is closed, then returns its first error.
func (w *oldWriter) run(ctx context.Context, stop <-chan struct{}) error {
	for i := 0; ; i++ {
		select {
		case <-stop:
			return nil
		default:
		}
		kinds := []func(context.Context) (string, error){w.claim, w.deadLetter, w.retryApplied, w.purge, w.release}
		start := time.Now()
		kind, err := kinds[i%len(kinds)](ctx)
		if err != nil {
			return fmt.Errorf("%s: %w", kind, err)
		}
		w.mu.Lock()
		w.ops = append(w.ops, writerOp{kind: kind, start: start, end: time.Now()})
		w.mu.Unlock()
	}
}

// randomRow is a seeded row's coordinates.
func (w *oldWriter) randomRow() (string, string, int32, int64) {
	return oldConsumers[w.rng.IntN(len(oldConsumers))], oldTopics[w.rng.IntN(len(oldTopics))],
		int32(w.rng.IntN(oldPartitions)), w.rng.Int64N(w.old.perPartition)
}

// claim is a batch of 50 records on the writer's partition, fenced by
// its cursor (epoch 3), through the ON CONFLICT path when a row of the
// range is there (the seeded rows above the high-water mark) and the
// plain INSERT when none is.
func (w *oldWriter) claim(ctx context.Context) (string, error) {
	p := writerPartition
	offsets := make([]int64, 50)
	for i := range offsets {
		offsets[i] = w.next + int64(i)
	}
	var moved int64
	var held bool
	var fresh []int64
	err := w.pool.QueryRow(ctx, fenceAndClaimSchema11, p.Consumer, p.Topic, p.Partition, int64(3), w.next, w.next+50, offsets, true).Scan(&moved, &held, &fresh)
	if err == nil && moved != 1 {
		err = fmt.Errorf("the cursor of %s did not move from %d", p, w.next)
	}
	if err != nil {
		return "claim", err
	}
	if !held {
		fresh = offsets
	}
	for _, o := range fresh {
		w.model[modelKey(p.Consumer, p.Topic, p.Partition, o)] = "epoch 3 applied"
	}
	w.next += 50
	return "claim", nil
}

// deadLetter dead-letters a row: an UPDATE, or an INSERT where it is
// gone.
func (w *oldWriter) deadLetter(ctx context.Context) (string, error) {
	c, tp, p, o := w.randomRow()
	if _, err := w.pool.Exec(ctx, markDeadLetteredSchema11, c, tp, p, o, int64(7)); err != nil {
		return "dead-letter", err
	}
	k := modelKey(c, tp, p, o)
	if before, ok := w.model[k]; ok {
		w.model[k] = strings.Fields(before)[0] + " " + strings.Fields(before)[1] + " dead_lettered"
	} else {
		w.model[k] = "epoch 7 dead_lettered"
	}
	return "dead-letter", nil
}

// retryApplied applies a retried dead letter: a seeded dead_lettered row
// (every 97th) becomes applied, with a new epoch and time.
func (w *oldWriter) retryApplied(ctx context.Context) (string, error) {
	c, tp, p, o := w.randomRow()
	o -= o % 97
	tag, err := w.pool.Exec(ctx, markRetryAppliedSchema11, c, tp, p, o, int64(8))
	if err != nil {
		return "retry-applied", err
	}
	if tag.RowsAffected() == 1 {
		w.model[modelKey(c, tp, p, o)] = "epoch 8 applied"
	}
	return "retry-applied", nil
}

// purge is retention (of rows older than an hour) over 40 rows of a
// partition's head, alternately a seeded partition and the writer's.
func (w *oldWriter) purge(ctx context.Context) (string, error) {
	c, tp, p, _ := w.randomRow()
	if w.rng.IntN(2) == 0 {
		c, tp, p = writerPartition.Consumer, writerPartition.Topic, writerPartition.Partition
	}
	return "purge", w.deleting(ctx, c, tp, p, purgeHeadSchema11, c, tp, p, 40, time.Hour)
}

// release deletes 20 rows for a re-execution, alternately of a seeded
// partition and of the writer's own fresh rows.
func (w *oldWriter) release(ctx context.Context) (string, error) {
	c, tp, p, o := w.randomRow()
	if w.rng.IntN(2) == 0 && w.next > w.old.highWater()+100 {
		c, tp, p = writerPartition.Consumer, writerPartition.Topic, writerPartition.Partition
		o = w.old.highWater() + w.rng.Int64N(w.next-w.old.highWater()-20)
	}
	return "release", w.deleting(ctx, c, tp, p, releaseSchema11, c, tp, p, o, o+20)
}

func (w *oldWriter) deleting(ctx context.Context, c, tp string, p int32, sql string, args ...any) error {
	rows, err := w.pool.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	deleted, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	for _, o := range deleted {
		delete(w.model, modelKey(c, tp, p, o))
	}
	return err
}

// modelRows is the writer's model as "key epoch E outcome" lines, in the
// order of a key's text.
func (w *oldWriter) modelRows() []string {
	out := make([]string, 0, len(w.model))
	for k, v := range w.model {
		out = append(out, k+" "+v)
	}
	slices.Sort(out)
	return out
}

// withoutTimes cuts the processed_at off rowsOf's lines and sorts them as
// modelRows are.
func withoutTimes(rows []string) []string {
	out := make([]string, len(rows))
	for i, r := range rows {
		f := strings.Split(r, " ")
		// key "epoch" E outcome date time: the key may hold spaces.
		out[i] = strings.Join(f[:len(f)-2], " ")
	}
	slices.Sort(out)
	return out
}

// TestMigration12CopiesTheInboxWhileOldWorkersWrite seeds an inbox of
// schema 11 with 153,600 rows (1,600 in each of 96 partitions) under names a hostile producer could give,
// and runs Migrate while a worker built for schema 11 keeps claiming,
// dead-lettering, applying retries, purging and releasing rows, until the
// swap starts. Every row the old table held then is in the new one, with
// its epoch, outcome and time, and no other; the writer's own account of
// what it committed agrees. An old row blocks its offset for the inbox's
// claim; every partition has its lane; the grants, the row-level security
// and the rest of the schema are what a new database gets. The writer's
// longest wait during the copy is a small part of the copy (the figures
// are in the log), and its writes fail after the swap.
func TestMigration12CopiesTheInboxWhileOldWorkersWrite(t *testing.T) {
	ctx := context.Background()
	old := seedOldInbox(t, 1_600)
	w := newOldWriter(old)
	stop, stopped := make(chan struct{}), make(chan error, 1)
	go func() { stopped <- w.run(ctx, stop) }()
	time.Sleep(200 * time.Millisecond) // the writer is under way before the migration

	var beforeSwap []string
	var copyStart, copyEnd, swapStart time.Time
	var copied, swapped schema.Progress
	var steps []schema.Step
	var printed strings.Builder
	printLine := schema.PrintProgress(&printed, "> ")
	migrateStart := time.Now()
	applied, err := schema.MigrateOnline(ctx, old.db.Pool, 5_000, func(p schema.Progress) {
		steps = append(steps, p.Step)
		printLine(p)
		switch p.Step {
		case schema.StepMirroring:
			copyStart = time.Now()
		case schema.StepCopied:
			copyEnd, copied = time.Now(), p
		case schema.StepSwapping:
			swapStart = time.Now()
			close(stop)
			if err := <-stopped; err != nil {
				t.Errorf("the old writer failed before the swap: %v", err)
			}
			beforeSwap = rowsOf(t, old.db.Pool, oldRowsSQL)
		case schema.StepSwapped:
			swapped = p
		}
	})
	if err != nil || !slices.Contains(applied, 12) {
		t.Fatalf("Migrate = %v, %v; want 12 applied", applied, err)
	}
	total := time.Since(migrateStart)
	// What kfn migrate prints: the copy's rows and rate, the swap's time.
	for _, line := range []string{
		"> migration 0012_compact_inbox, online: copying kfn.inbox into kfn.inbox_compact while workers keep running",
		fmt.Sprintf("> migration 0012_compact_inbox, online: copied %d rows of kfn.inbox in ", copied.Rows),
		"> migration 0012_compact_inbox: swapping kfn.inbox for its copy: workers built for an older schema stop here\n> migration 0012_compact_inbox: swapped in ",
	} {
		if !strings.Contains(printed.String(), line) {
			t.Errorf("Migrate's progress, as kfn migrate prints it, lacks %q:\n%s", line, printed.String())
		}
	}
	if want := []schema.Step{schema.StepMirroring, schema.StepCopied, schema.StepSwapping, schema.StepSwapped}; !slices.Equal(slices.DeleteFunc(steps, func(s schema.Step) bool {
		return s == schema.StepCopying || s == schema.StepWaiting
	}), want) {
		t.Fatalf("Migrate reported steps %v; want %v with StepCopying between", steps, want)
	}

	// What the old writer did during the copy, and its longest wait while
	// Migrate prepared (the triggers' transaction and the copy).
	kinds := map[string]int{}
	var longest writerOp
	for _, op := range w.ops {
		if op.end.After(copyStart) && op.start.Before(copyEnd) {
			kinds[op.kind]++
		}
		if op.end.After(migrateStart) && op.start.Before(swapStart) && op.end.Sub(op.start) > longest.end.Sub(longest.start) {
			longest = op
		}
	}
	for _, kind := range []string{"claim", "dead-letter", "retry-applied", "purge", "release"} {
		if kinds[kind] == 0 {
			t.Errorf("the old writer committed no %s during the copy (%v): the test did not race the copy", kind, kinds)
		}
	}
	copying := copyEnd.Sub(copyStart)
	pause := longest.end.Sub(longest.start)
	t.Logf("copied %d rows in %s (%s); the old writer's longest wait while Migrate prepared: %s (a %s), %d writes during the copy %v; the swap: %s; Migrate in all: %s",
		copied.Rows, copying.Round(time.Millisecond), copied, pause.Round(time.Millisecond), longest.kind, len(w.ops), kinds, swapped.Elapsed.Round(time.Millisecond), total.Round(time.Millisecond))
	if pause > copying/3 {
		t.Errorf("the old writer waited %s for a %s while Migrate prepared, the copy took %s: the copy must not hold the workers", pause, longest.kind, copying)
	}
	if swapped.Elapsed > copying/3 {
		t.Errorf("the swap took %s, the copy %s: the swap must not copy the rows again", swapped.Elapsed, copying)
	}

	// Every row, and no other.
	after := rowsOf(t, old.db.Pool, newRowsSQL)
	if !slices.Equal(after, beforeSwap) {
		missing, extra := diffRows(beforeSwap, after)
		t.Errorf("the new inbox holds %d rows, the old held %d before the swap: missing %d %q, extra %d %q", len(after), len(beforeSwap), len(missing), firstRows(missing), len(extra), firstRows(extra))
	}
	if model, got := w.modelRows(), withoutTimes(after); !slices.Equal(model, got) {
		missing, extra := diffRows(model, got)
		t.Errorf("the new inbox disagrees with what the old writer committed: missing %d %q, extra %d %q", len(missing), firstRows(missing), len(extra), firstRows(extra))
	}
	checkLanes(t, old.db.Pool, beforeSwap)
	checkEndState(t, old)
	checkOldRowsBlock(t, old, w)

	// A worker built for schema 11 fails from the swap on.
	var pgErr *pgconn.PgError
	_, err = old.worker.Exec(ctx, markDeadLetteredSchema11, "orders", "t", int32(0), int64(5), int64(9))
	if !errors.As(err, &pgErr) || pgErr.Code != "42703" {
		t.Errorf("a write of schema 11 after the swap: %v; want undefined_column (42703)", err)
	}
}

// checkLanes checks that every partition of the old inbox's rows (before,
// as rowsOf gives them) and of the cursors has one lane, and that no
// other has one.
func checkLanes(t *testing.T, pool *pgxpool.Pool, before []string) {
	t.Helper()
	want := map[string]bool{}
	for _, r := range before {
		key, _, _ := strings.Cut(r, " epoch ")
		at := strings.LastIndex(key, "@")
		want[key[:at]] = true
	}
	rows, err := pool.Query(context.Background(), `SELECT format('%s/%s/%s', consumer, topic, partition) FROM kfn.cursors`)
	if err != nil {
		t.Fatal(err)
	}
	cursors, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cursors {
		want[c] = true
	}
	var lanes []string
	var ids int
	if err := pool.QueryRow(context.Background(), newLanesSQL).Scan(&lanes, &ids); err != nil {
		t.Fatal(err)
	}
	wanted := make([]string, 0, len(want))
	for k := range want {
		wanted = append(wanted, k)
	}
	slices.Sort(wanted)
	slices.Sort(lanes)
	if !slices.Equal(lanes, wanted) || ids != len(lanes) {
		t.Errorf("%d lanes (%d ids): %q…; want one for each of the %d partitions of the old rows and the cursors: %q…", len(lanes), ids, firstRows(lanes), len(wanted), firstRows(wanted))
	}
}

// checkEndState compares the migrated database with a new one: the same
// tables, columns, constraints, indexes, types, functions, triggers and
// row-level security policies (nothing of the online copy is left), and
// the old inbox's grants on the new inbox.
func checkEndState(t *testing.T, old oldInbox) {
	t.Helper()
	fresh := kfntest.Postgres(t)
	if got, want := schemaShape(t, old.db.Pool), schemaShape(t, fresh.Pool); !slices.Equal(got, want) {
		missing, extra := diffRows(want, got)
		t.Errorf("the schema after the online migration differs from a new database's: lacks %q, has more %q", missing, extra)
	}
	// A new database gets the same 0012: what it makes is checked here.
	var options []string
	if err := old.db.Pool.QueryRow(context.Background(), `SELECT reloptions FROM pg_class WHERE oid = 'kfn.inbox'::regclass`).Scan(&options); err != nil || options != nil {
		t.Errorf("kfn.inbox has the options %q (%v); want none, as any table", options, err)
	}
	if got := tableACL(t, old.db.Pool, "kfn.inbox"); !slices.Equal(got, old.acl) {
		t.Errorf("grants on kfn.inbox after the migration %q; before %q", got, old.acl)
	}
	var lanesACL []string
	for _, g := range old.acl {
		if strings.HasSuffix(g, " SELECT") || strings.HasSuffix(g, " INSERT") {
			lanesACL = append(lanesACL, g)
		}
	}
	if got := tableACL(t, old.db.Pool, "kfn.lanes"); !slices.Equal(got, lanesACL) {
		t.Errorf("grants on kfn.lanes after the migration %q; want %q", got, lanesACL)
	}
}

// schemaShape lists, as text, what kfn's schema is made of.
func schemaShape(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
SELECT format('column %s.%s %s %s %s', table_name, column_name, data_type, is_nullable, column_default)
  FROM information_schema.columns WHERE table_schema = 'kfn'
UNION ALL
SELECT format('constraint %s %s %s', conrelid::regclass, conname, pg_get_constraintdef(oid))
  FROM pg_constraint WHERE connamespace = 'kfn'::regnamespace
UNION ALL
SELECT format('index %s', indexdef) FROM pg_indexes WHERE schemaname = 'kfn'
UNION ALL
SELECT format('policy %s.%s %s %s %s', tablename, policyname, cmd, qual, with_check) FROM pg_policies WHERE schemaname = 'kfn'
UNION ALL
SELECT format('table %s rls %s %s options %s', oid::regclass, relrowsecurity, relforcerowsecurity, reloptions) FROM pg_class WHERE relnamespace = 'kfn'::regnamespace AND relkind = 'r'
UNION ALL
SELECT format('function %s %s', oid::regprocedure, prosecdef) FROM pg_proc WHERE pronamespace = 'kfn'::regnamespace
UNION ALL
SELECT format('trigger %s %s', tgrelid::regclass, tgname) FROM pg_trigger WHERE NOT tgisinternal AND tgrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'kfn'::regnamespace)
UNION ALL
SELECT format('type %s %s', typname, (SELECT array_agg(enumlabel ORDER BY enumsortorder) FROM pg_enum WHERE enumtypid = t.oid))
  FROM pg_type t WHERE typnamespace = 'kfn'::regnamespace AND typtype = 'e'
UNION ALL
SELECT format('migration %s %s %s', version, name, breaks_before) FROM kfn.schema_migrations`)
	if err != nil {
		t.Fatal(err)
	}
	shape, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(shape)
	return shape
}

// checkOldRowsBlock claims, as the old installation's worker role and
// through the inbox package, offsets of a partition whose old rows are
// there (below and above the high-water mark, applied and dead-lettered)
// and of ranges the writer deleted: only the offsets with no row are
// fresh. The claim is rolled back.
func checkOldRowsBlock(t *testing.T, old oldInbox, w *oldWriter) {
	t.Helper()
	ctx := context.Background()
	for _, c := range oldConsumers {
		p := inbox.Partition{Consumer: c, Topic: oldTopics[2], Partition: 3}
		var offsets, want []int64
		for o := int64(0); o < old.perPartition+10; o += 7 {
			offsets = append(offsets, o)
			if _, ok := w.model[modelKey(p.Consumer, p.Topic, p.Partition, o)]; !ok {
				want = append(want, o)
			}
		}
		err := pgx.BeginFunc(ctx, old.worker, func(tx pgx.Tx) error {
			fresh, err := inbox.Claim(ctx, tx, p, 4, inbox.Applied, offsets)
			if err == nil && !slices.Equal(fresh, want) {
				t.Errorf("claiming %d offsets of %s after the migration claimed %v; want only those with no row, %v", len(offsets), p, fresh, want)
			}
			if err == nil {
				err = errRollBack
			}
			return err
		})
		if !errors.Is(err, errRollBack) {
			t.Fatalf("claim %s: %v", p, err)
		}
	}
}

var errRollBack = errors.New("roll back")

// diffRows returns what want has and got lacks, and the other way round;
// both sorted.
func diffRows(want, got []string) (missing, extra []string) {
	in := func(s []string, x string) bool { _, ok := slices.BinarySearch(s, x); return ok }
	want, got = slices.Sorted(slices.Values(want)), slices.Sorted(slices.Values(got))
	for _, x := range want {
		if !in(got, x) {
			missing = append(missing, x)
		}
	}
	for _, x := range got {
		if !in(want, x) {
			extra = append(extra, x)
		}
	}
	return missing, extra
}

func firstRows(rows []string) []string { return rows[:min(len(rows), 5)] }

// claimSchema11 is inbox.Claim of schema 11.
const claimSchema11 = `
INSERT INTO kfn.inbox (consumer, topic, partition, "offset", epoch, outcome)
SELECT $1, $2, $3, o, $4, $5 FROM unnest($6::bigint[]) AS o
ON CONFLICT DO NOTHING
RETURNING "offset"`

// TestMigration12OnlineCopyInterruptedIsCompletedByMigratingAgain stops
// Migrate during the online copy of an inbox of schema 11 (19,200 rows,
// batches of 1,000), or right before the swap, as if the migrator were
// killed there: the schema stays at 11, the triggers stay, and workers
// built for schema 11 write on (new rows, updates, deletes; a TRUNCATE).
// Migrate then goes on from where the copy stopped, and the new inbox
// holds exactly the old one's rows; so it does when migration 0012 is
// applied without the online copy after an unfinished one.
func TestMigration12OnlineCopyInterruptedIsCompletedByMigratingAgain(t *testing.T) {
	for _, tc := range []struct {
		name string
		stop schema.Step // where Migrate is stopped: after half the rows (StepCopying), or before the swap
		// Then, while it is stopped, whether the inbox is truncated, and
		// whether migration 0012 is applied without the online copy.
		truncate, offline bool
	}{
		{name: "during the copy", stop: schema.StepCopying},
		{name: "before the swap", stop: schema.StepSwapping},
		{name: "during the copy, then without the online copy", stop: schema.StepCopying, offline: true},
		{name: "during the copy, then truncated", stop: schema.StepCopying, truncate: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			old := seedOldInbox(t, 200)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			_, err := schema.MigrateOnline(ctx, old.db.Pool, 1_000, func(p schema.Progress) {
				if p.Step == tc.stop && (p.Step != schema.StepCopying || p.Rows >= 9_000) {
					cancel() // the migrator is killed: its session ends
				}
			})
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("Migrate stopped at step %d: %v; want the context's cancellation", tc.stop, err)
			}
			var version, triggers int
			var copied int64
			var done bool
			err = old.db.Pool.QueryRow(context.Background(), `SELECT (SELECT max(version) FROM kfn.schema_migrations),
			         (SELECT count(*) FROM pg_trigger WHERE tgrelid = 'kfn.inbox'::regclass), copied, done FROM kfn.inbox_backfill`).
				Scan(&version, &triggers, &copied, &done)
			if err != nil || version != 11 || triggers != 4 || copied < 9_000 || done != (tc.stop == schema.StepSwapping) {
				t.Fatalf("after the interruption: schema %d, %d triggers on kfn.inbox, %d rows recorded copied, done %v (%v); want 11, 4, at least 9000, %v",
					version, triggers, copied, done, err, tc.stop == schema.StepSwapping)
			}
			writeWhileStopped(t, old, tc.truncate)
			before := rowsOf(t, old.db.Pool, oldRowsSQL)

			var steps []schema.Progress
			var applied []int
			if tc.offline {
				applied, err = schema.MigrateOffline(context.Background(), old.db.Pool)
			} else {
				applied, err = schema.MigrateOnline(context.Background(), old.db.Pool, 1_000, func(p schema.Progress) { steps = append(steps, p) })
			}
			if err != nil || !slices.Contains(applied, 12) {
				t.Fatalf("Migrate again = %v, %v; want 12 applied", applied, err)
			}
			if !tc.offline {
				// It went on from where it stopped: the copy's progress
				// starts at the rows copied before.
				i := slices.IndexFunc(steps, func(p schema.Progress) bool { return p.Step == schema.StepCopying || p.Step == schema.StepCopied })
				if i < 0 || steps[i].Resumed != copied || steps[i].Rows < copied || (tc.stop == schema.StepSwapping) != (steps[i].Step == schema.StepCopied) {
					t.Errorf("the copy's first progress after the interruption: %+v; want it to go on from %d rows copied", steps[i:], copied)
				}
			}
			after := rowsOf(t, old.db.Pool, newRowsSQL)
			if !slices.Equal(after, before) {
				missing, extra := diffRows(before, after)
				t.Errorf("the new inbox holds %d rows, the old held %d: missing %d %q, extra %d %q", len(after), len(before), len(missing), firstRows(missing), len(extra), firstRows(extra))
			}
			checkLanes(t, old.db.Pool, before)
			checkEndState(t, old)
		})
	}
}

// writeWhileStopped writes to every partition of old's inbox as workers
// built for schema 11 do: 3 new rows, 20 released, one dead-lettered, one
// retried dead letter applied; and claims rows of a partition that has no
// lane yet. With truncate the inbox is truncated first.
func writeWhileStopped(t *testing.T, old oldInbox, truncate bool) {
	t.Helper()
	ctx := context.Background()
	if truncate {
		if _, err := old.db.Pool.Exec(ctx, `TRUNCATE kfn.inbox`); err != nil {
			t.Fatal(err)
		}
	}
	b := &pgx.Batch{}
	for _, c := range oldConsumers {
		for _, tp := range oldTopics {
			for p := range int32(oldPartitions) {
				per := old.perPartition
				b.Queue(claimSchema11, c, tp, p, int64(5), "applied", []int64{per, per + 1, per + 2})
				b.Queue(releaseSchema11, c, tp, p, int64(10), int64(30))
				b.Queue(markDeadLetteredSchema11, c, tp, p, int64(50), int64(6))
				b.Queue(markRetryAppliedSchema11, c, tp, p, int64(97), int64(7))
			}
		}
	}
	b.Queue(claimSchema11, "a new function", "t", int32(9), int64(5), "applied", []int64{0, 1, 2})
	if err := old.worker.SendBatch(ctx, b).Close(); err != nil {
		t.Fatal(err)
	}
}

// TestMigration12WaitsForTheInboxLockInTurns holds a lock on the old
// inbox that the triggers' creation waits for. Migrate gives up waiting
// after its lock timeout (here 50 ms, so that the workers queued behind
// it are not held longer), says so, and tries again: it migrates once the
// lock is gone, and fails, naming the cause, when it stays through all
// its attempts.
func TestMigration12WaitsForTheInboxLockInTurns(t *testing.T) {
	for _, tc := range []struct {
		name    string
		hold    time.Duration
		succeed bool
	}{
		{"released", 300 * time.Millisecond, true},
		{"held", 3 * time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := kfntest.PostgresEmpty(t)
			if _, err := schema.MigrateTo(ctx, db.Pool, 11); err != nil {
				t.Fatal(err)
			}
			locked, held := make(chan struct{}), make(chan error, 1)
			go func() {
				held <- pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `LOCK TABLE kfn.inbox IN SHARE MODE`)
					close(locked)
					time.Sleep(tc.hold)
					return err
				})
			}()
			<-locked
			var waits int
			applied, err := schema.MigrateWaiting(ctx, db.Pool, 50*time.Millisecond, func(p schema.Progress) {
				if p.Step == schema.StepWaiting {
					waits++
				}
			})
			switch {
			case tc.succeed && (err != nil || !slices.Contains(applied, 12) || waits == 0):
				t.Errorf("Migrate = %v, %v after %d waits; want 12 applied after waits of 50 ms", applied, err, waits)
			case !tc.succeed && (err == nil || !strings.Contains(err.Error(), "another transaction held kfn.inbox through 20 waits of 50ms") || waits != 19):
				t.Errorf("Migrate = %v, %v after %d waits; want it to give up after 20 attempts, naming the cause", applied, err, waits)
			}
			if err := <-held; err != nil {
				t.Error(err)
			}
		})
	}
}
