package console

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/dlqtest"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// TestConsoleActsInEachFunctionsDatabase runs function
// a on one database and b on another, each with a real worker, and a
// console with --database-url a's and --function-databases b's. Each
// database has a dead letter with id 1 (a's seeded, b's a poison record),
// so an action in the wrong database would hit the other's letter. The
// overview shows both functions' lanes, the dead letters page both
// groups; retrying b's letter marks it in b's database, b's worker
// applies it there, a's letter 1 stays untouched, and the audit of the
// retry is in b's database under console:alice, on the merged audit page.
func TestConsoleActsInEachFunctionsDatabase(t *testing.T) {
	dbA, dbB := kfntest.Postgres(t), kfntest.Postgres(t)
	k := kfntest.Kafka(t)
	natsURL := kfntest.NATSURL(t)
	a, b := kfntest.Name(t, "a"), kfntest.Name(t, "b")
	topicA, topicB := k.CreateTopic(t, 1), k.CreateTopic(t, 1)
	ctx := context.Background()

	fnB := effects.Function(b, topicB)
	var fixed atomic.Bool
	apply := fnB.Handler
	fnB.Handler = func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
		if strings.HasPrefix(string(rec.Value), "poison") && !fixed.Load() {
			return runtime.Permanent(errors.New("cannot decode order 7"))
		}
		return apply(ctx, tx, rec, out)
	}
	k.Produce(t, topicA, kafka.Message{Key: []byte("x"), Value: []byte("ok a")})
	k.Produce(t, topicB, kafka.Message{Key: []byte("y"), Value: []byte("ok b")}, kafka.Message{Key: []byte("z"), Value: []byte("poison b")},
		kafka.Message{Key: []byte("y"), Value: []byte("ok b 2")})
	aLetter := dlqtest.Seed(t, dbA.Pool, dlqtest.Letter{Function: a, Topic: topicA, Partition: 0, Offset: 900, Reason: "permanent", Error: "a's own letter"})[0]
	for _, w := range []struct {
		db *kfntest.PG
		fn runtime.Function
	}{{dbA, effects.Function(a, topicA)}, {dbB, fnB}} {
		cfg := runtime.Config{KafkaBrokers: k.Brokers, DatabaseURL: w.db.URL, NATSURL: natsURL, WorkerID: "worker-" + w.fn.Name,
			LeaseTTL: 2 * time.Second, LeaseRenew: 500 * time.Millisecond, LeaseBucket: kfntest.Name(t, "leases"), RetryAttempts: 1, RetryInitial: 10 * time.Millisecond}
		wk, err := worker.New(ctx, cfg, w.fn)
		if err != nil {
			t.Fatal(err)
		}
		kfntest.Background(t, w.fn.Name, wk.Run)
	}
	count := func(pool *pgxpool.Pool, sql string, args ...any) int {
		t.Helper()
		var n int
		if err := pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	var bLetter int64
	kfntest.Await(t, 30*time.Second, "b's poison record dead-lettered in b's database and both cursors at the end", func() (bool, string) {
		ca := count(dbA.Pool, `SELECT coalesce(max(next_offset), 0) FROM kfn.cursors WHERE consumer = $1`, a)
		cb := count(dbB.Pool, `SELECT coalesce(max(next_offset), 0) FROM kfn.cursors WHERE consumer = $1`, b)
		dead := count(dbB.Pool, `SELECT count(*) FROM kfn.dead_letters WHERE consumer = $1`, b)
		return ca == 1 && cb == 3 && dead == 1, fmt.Sprintf("a's cursor %d, b's cursor %d, b's dead letters %d", ca, cb, dead)
	})
	if err := dbB.Pool.QueryRow(ctx, `SELECT id FROM kfn.dead_letters WHERE consumer = $1`, b).Scan(&bLetter); err != nil {
		t.Fatal(err)
	}
	if bLetter != aLetter {
		t.Fatalf("b's letter is %d and a's %d: the test needs the same id in both databases", bLetter, aLetter)
	}

	s, err := New(Config{Pool: dbA.Pool, FunctionPools: map[string]*pgxpool.Pool{b: dbB.Pool}, Users: testUsers(t), AllowWrites: true, KafkaBrokers: k.Brokers})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	if err := s.CheckDatabases(ctx); err != nil {
		t.Fatalf("CheckDatabases with each function in its own database: %v", err)
	}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	c := client(t)
	token := login(t, c, srv.URL, "alice", "alice-secret")

	_, body := get(t, c, srv.URL, "/overview/live")
	for _, fn := range []string{a, b} {
		if !strings.Contains(body, `data-function="`+fn+`"`) {
			t.Errorf("the overview has no lane of %s:\n%s", fn, body)
		}
	}
	_, body = get(t, c, srv.URL, "/deadletters")
	if !strings.Contains(body, "a&#39;s own letter") || !strings.Contains(body, "cannot decode order &lt;n&gt;") {
		t.Errorf("the dead letters page lacks a's or b's group:\n%s", body)
	}
	if code, body := get(t, c, srv.URL, "/deadletters/"+itoa(bLetter)+"?function="+b); code != http.StatusOK || !strings.Contains(body, "cannot decode order 7") {
		t.Errorf("b's letter %d: %d, want b's letter from b's database:\n%s", bLetter, code, body)
	}
	if code, body := get(t, c, srv.URL, "/deadletters/"+itoa(bLetter)); code != http.StatusNotFound || !strings.Contains(body, "say which function") {
		t.Errorf("letter %d without its function over two databases: %d, want 404 asking for the function:\n%s", bLetter, code, body)
	}

	// Ids without their function: ambiguous over two databases, refused,
	// nothing marked.
	code, body := post(t, c, srv.URL, "/deadletters/retry", url.Values{"csrf": {token}, "id": {itoa(bLetter)}, "reason": {"which one?"}})
	if code != http.StatusBadRequest || !strings.Contains(body, "say which function") {
		t.Errorf("retry of letter %d without its function: %d, want 400 asking for the function:\n%s", bLetter, code, body)
	}
	for _, pool := range []*pgxpool.Pool{dbA.Pool, dbB.Pool} {
		if n := count(pool, `SELECT count(*) FROM kfn.dead_letters WHERE retry_requested_at IS NOT NULL`); n != 0 {
			t.Fatalf("%d letters marked by a refused retry", n)
		}
	}

	fixed.Store(true)
	code, body = post(t, c, srv.URL, "/deadletters/retry", url.Values{"csrf": {token}, "function": {b}, "id": {itoa(bLetter)}, "reason": {"INC-9 decoder fixed"}})
	if code != http.StatusOK || !strings.Contains(body, "Marked 1 dead letters for retry") {
		t.Fatalf("retry b's letter: %d\n%s", code, body)
	}
	kfntest.Await(t, 30*time.Second, "b's worker to apply the retried letter in b's database", func() (bool, string) {
		applied := count(dbB.Pool, `SELECT count(*) FROM `+effects.Table(b)+` WHERE value = 'poison b'`)
		left := count(dbB.Pool, `SELECT count(*) FROM kfn.dead_letters WHERE consumer = $1`, b)
		return applied == 1 && left == 0, fmt.Sprintf("%d effect rows of the poison record, %d letters of b left", applied, left)
	})
	if n := count(dbA.Pool, `SELECT count(*) FROM kfn.dead_letters WHERE id = $1 AND consumer = $2 AND retry_requested_at IS NULL`, aLetter, a); n != 1 {
		t.Errorf("a's letter %d after retrying b's: %d untouched, want 1", aLetter, n)
	}
	if n := count(dbB.Pool, `SELECT count(*) FROM kfn.audit_log WHERE actor = 'console:alice' AND action = 'dlq_retry_requested' AND consumer = $1`, b); n != 1 {
		t.Errorf("%d retry rows of b by console:alice in b's database, want 1", n)
	}
	if n := count(dbA.Pool, `SELECT count(*) FROM kfn.audit_log WHERE actor = 'console:alice'`); n != 0 {
		t.Errorf("%d rows by console:alice in a's database, want 0", n)
	}
	_, body = get(t, c, srv.URL, "/audit?actor=console:alice")
	if strings.Count(body, `<td class="actor">console:alice</td>`) != 1 || !strings.Contains(body, b) {
		t.Errorf("the audit page does not list alice's retry of b:\n%s", body)
	}

	// Verify reads b's own database: b's three records, one applied by
	// the retry, are clean there (a's database has no cursor of b).
	if _, body := get(t, c, srv.URL, "/verify?function="+b+"&topic="+topicB); !strings.Contains(body, "Clean: no violation") {
		t.Errorf("the verify page on b does not find b clean in b's database:\n%s", body)
	}

	// b's letter written into a's database too: b is in two databases,
	// and the console refuses to start. Until then the pages show only
	// what each function's own database holds: a key of b parked in a's
	// database is not counted.
	dlqtest.Seed(t, dbA.Pool, dlqtest.Letter{Function: b, Topic: topicB, Partition: 0, Offset: 1, Reason: "permanent", Error: "stray"})
	if _, err := dbA.Pool.Exec(ctx, `INSERT INTO kfn.parked_keys (consumer, topic, partition, record_key, blocking_offset) VALUES ($1, $2, 0, 'k', 1)`, b, topicB); err != nil {
		t.Fatal(err)
	}
	if _, body := get(t, c, srv.URL, "/overview/live"); !strings.Contains(body, `<span class="n" id="parked-count">0</span>`) {
		t.Errorf("the overview counts a key of b parked in a's database:\n%s", body)
	}
	err = s.CheckDatabases(ctx)
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("function %q is in two databases: its own in --function-databases, and --database-url's too", b)) {
		t.Fatalf("CheckDatabases with b's letter in a's database: %v", err)
	}
}

// TestConsoleWithOnlyFunctionDatabasesRefusesAnUnlistedFunction is a
// console given no --database-url, only b's own database: a page about a
// function it has no database for says so and names the flags, and the
// pages about every function show b's.
func TestConsoleWithOnlyFunctionDatabasesRefusesAnUnlistedFunction(t *testing.T) {
	db := kfntest.Postgres(t)
	dlqtest.Seed(t, db.Pool, dlqtest.Letter{Function: "b", Topic: "src", Offset: 1, Reason: "permanent", Error: "b's letter"})
	s, err := New(Config{FunctionPools: map[string]*pgxpool.Pool{"b": db.Pool}, Users: testUsers(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	c := client(t)
	login(t, c, srv.URL, "victor", "victor-secret")
	for _, path := range []string{"/deadletters?function=a", "/parked?function=a", "/audit?function=a", "/deadletters/group?function=a&reason=permanent&fp=x"} {
		_, body := get(t, c, srv.URL, path)
		if !strings.Contains(body, `function &#34;a&#34; has no database: it is not in --function-databases, and the console has no --database-url`) {
			t.Errorf("GET %s: no error naming the flags:\n%s", path, body)
		}
	}
	if _, body := get(t, c, srv.URL, "/deadletters"); !strings.Contains(body, "b&#39;s letter") {
		t.Errorf("the dead letters page lacks b's letter:\n%s", body)
	}
}

// TestReadPageMergesTheDatabasesPageByPage pages through the rows of two
// databases (stand-ins: each pool pointer keys its own sorted rows) two
// at a time: every row shows once, in the merged order, and the rows
// keep leaves out are left out.
func TestReadPageMergesTheDatabasesPageByPage(t *testing.T) {
	one, two := &pgxpool.Pool{}, &pgxpool.Pool{}
	rows := map[*pgxpool.Pool][]int{one: {1, 3, 5, 7, 8}, two: {2, 4, 6}}
	read := func(pool *pgxpool.Pool, page operator.Page) ([]int, error) {
		all := rows[pool]
		all = all[min(page.Offset, len(all)):]
		if page.Limit > 0 {
			all = all[:min(page.Limit, len(all))]
		}
		return all, nil
	}
	notEight := func(_ *pgxpool.Pool, n int) bool { return n != 8 }
	var got [][]int
	for offset := 0; offset < 10; offset += 2 {
		page, err := readPage([]*pgxpool.Pool{one, two}, operator.Page{Limit: 2, Offset: offset}, read, notEight, cmp.Compare[int])
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, page)
	}
	if fmt.Sprint(got) != "[[1 2] [3 4] [5 6] [7] []]" {
		t.Fatalf("pages of two databases: %v, want [[1 2] [3 4] [5 6] [7] []]", got)
	}
}
