package console

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// benchLanes and benchDeadLetters are the load the overview must refresh
// under in less than 300 ms (docs/console.md).
const (
	benchLanes       = 64
	benchDeadLetters = 100_000
)

// loadedConsole is a console over a database with benchLanes claimed
// partitions of a Kafka topic of that many partitions and benchDeadLetters
// dead letters spread over the last two hours, with NATS for the lease
// holders: what one overview refresh reads.
func loadedConsole(b *testing.B) (*httptest.Server, *kfntest.PG) {
	b.Helper()
	ctx := context.Background()
	db := kfntest.Postgres(b)
	k := kfntest.Kafka(b)
	topic := k.CreateTopic(b, benchLanes)
	nc, js, err := connect.NATSWith(kfntest.NATSURL(b), "console bench", runtime.NATSSecurity{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(nc.Close)
	for p := range int32(benchLanes) {
		if _, err := inbox.ClaimPartition(ctx, db.Pool, inbox.Partition{Consumer: "bench", Topic: topic, Partition: p}, 1, "worker-1", 0); err != nil {
			b.Fatal(err)
		}
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO kfn.dead_letters (consumer, topic, partition, "offset", record_key, value, reason, error, attempts, dead_at)
 SELECT 'bench', $1, i % $2, i, convert_to('key-' || i, 'UTF8'), convert_to('{"order":' || i || '}', 'UTF8'),
        (ARRAY['handler_error', 'permanent', 'data_error'])[1 + i % 3],
        (ARRAY['order ', 'decode: bad byte at ', 'timeout after '])[1 + i % 3] || i || ' in ' || md5(i::text),
        5, now() - (i % 7200) * interval '1 second'
   FROM generate_series(1, $3) AS i`, topic, benchLanes, benchDeadLetters); err != nil {
		b.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `ANALYZE kfn.dead_letters`); err != nil {
		b.Fatal(err)
	}
	s, err := New(Config{Pool: db.Pool, JS: js, KafkaBrokers: k.Brokers, ProxyHeader: "X-Forwarded-User"})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(s.Close)
	srv := httptest.NewServer(s)
	b.Cleanup(srv.Close)
	return srv, db
}

// fetch GETs path as user bench and checks the page holds want.
func fetch(b *testing.B, srv *httptest.Server, path, want string) {
	req, _ := http.NewRequest(http.MethodGet, srv.URL+path, nil)
	req.Header.Set("X-Forwarded-User", "bench")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusOK || !strings.Contains(string(body), want) {
		b.Fatalf("GET %s: %d, no %q in:\n%.2000s", path, res.StatusCode, want, body)
	}
}

// BenchmarkOverviewRefresh is one live refresh of the overview (what
// console.js fetches every 2 s) over HTTP: 64 lanes with their lease
// holders and Kafka lag, the dead letters of the last hour out of 100,000,
// the parked keys and the relay's backlog.
func BenchmarkOverviewRefresh(b *testing.B) {
	srv, _ := loadedConsole(b)
	fetch(b, srv, "/overview/live", fmt.Sprintf(`data-lane="%d"`, benchLanes-1))
	start := time.Now()
	for b.Loop() {
		fetch(b, srv, "/overview/live", `id="dead-hour">`)
	}
	b.ReportMetric(float64(time.Since(start).Milliseconds())/float64(b.N), "ms/refresh")
}

// BenchmarkDeadLetterGroups is the dead letters page over 100,000 letters:
// grouping them by function, reason and error fingerprint.
func BenchmarkDeadLetterGroups(b *testing.B) {
	srv, _ := loadedConsole(b)
	start := time.Now()
	for b.Loop() {
		fetch(b, srv, "/deadletters", "order &lt;n&gt; in &lt;n&gt;")
	}
	b.ReportMetric(float64(time.Since(start).Milliseconds())/float64(b.N), "ms/page")
}
