package kfntest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/schema"
)

func TestMain(m *testing.M) { Main(m) }

func TestPostgresGivesFreshMigratedDatabases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a := Postgres(t)
	var dropped string
	t.Run("inner", func(t *testing.T) {
		b := Postgres(t)
		dropped = b.Database
		if a.Database == b.Database || a.URL == b.URL {
			t.Fatalf("two calls gave the same database %s", a.Database)
		}
		for _, pg := range []*PG{a, b} {
			if err := schema.Check(ctx, pg.Pool); err != nil {
				t.Fatalf("database %s is not migrated: %v", pg.Database, err)
			}
		}
		if _, err := b.Pool.Exec(ctx, "CREATE TABLE only_in_b (v int)"); err != nil {
			t.Fatal(err)
		}
		var n int
		if err := a.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE tablename = 'only_in_b'").Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Fatalf("a table made in %s is visible in %s", b.Database, a.Database)
		}
		if !strings.Contains(b.URL, "/"+b.Database) {
			t.Fatalf("URL %s does not name database %s", b.URL, b.Database)
		}
	})
	var n int
	if err := a.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_database WHERE datname = $1", dropped).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("database %s still exists after its test ended", dropped)
	}
}

func TestPostgresEmptyIsNotMigrated(t *testing.T) {
	t.Parallel()
	pg := PostgresEmpty(t)
	if err := schema.Check(context.Background(), pg.Pool); !errors.Is(err, schema.ErrSchemaMissing) {
		t.Fatalf("schema.Check on an empty database = %v, want ErrSchemaMissing", err)
	}
}

func TestName(t *testing.T) {
	t.Parallel()
	valid := regexp.MustCompile(`^[A-Za-z0-9_-]+$`)
	seen := map[string]bool{}
	for _, prefix := range []string{"orders", "", "a.b c/d", strings.Repeat("x", 200)} {
		n := Name(t, prefix)
		if !valid.MatchString(n) || len(n) > maxNameLen {
			t.Errorf("Name(%q) = %q: want only [A-Za-z0-9_-] and at most %d bytes", prefix, n, maxNameLen)
		}
		if seen[n] {
			t.Errorf("Name(%q) = %q twice", prefix, n)
		}
		seen[n] = true
	}
	if n := Name(t, "orders"); !strings.HasPrefix(n, "orders-TestName-") {
		t.Errorf("Name(t, \"orders\") = %q, want prefix orders-TestName-", n)
	}
	t.Run("sub/test with spaces", func(t *testing.T) {
		if n := Name(t, "kv"); !valid.MatchString(n) {
			t.Errorf("Name in a subtest = %q", n)
		}
	})
}

func TestNATSURLServesJetStreamKV(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	nc, err := nats.Connect(NATSURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if NATSURL(t) != nc.ConnectedUrl() {
		t.Errorf("NATSURL changed between calls or differs from the connected URL %s", nc.ConnectedUrl())
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	bucket := Name(t, "leases") // must be a valid bucket name, or this fails
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 1})
	if err != nil {
		t.Fatalf("create KV bucket %q: %v", bucket, err)
	}
	t.Cleanup(func() { _ = js.DeleteKeyValue(context.Background(), bucket) })
	rev, err := kv.Create(ctx, "p0", []byte("owner-a"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Create(ctx, "p0", []byte("owner-b")); err == nil {
		t.Fatal("a second Create of the same key succeeded")
	}
	if _, err := kv.Update(ctx, "p0", []byte("owner-a"), rev); err != nil {
		t.Fatalf("Update at revision %d: %v", rev, err)
	}
}

func TestKafkaCreateProduceHighWatermarks(t *testing.T) {
	t.Parallel()
	k := Kafka(t)
	if k.Embedded == (os.Getenv(EnvKafkaBrokers) != "") {
		t.Errorf("Embedded = %v with %s=%q", k.Embedded, EnvKafkaBrokers, os.Getenv(EnvKafkaBrokers))
	}
	topic := k.CreateTopic(t, 3)
	if other := k.CreateTopic(t, 1); other == topic {
		t.Fatalf("CreateTopic returned %s twice", topic)
	}
	if hw := k.HighWatermarks(t, topic); len(hw) != 3 || hw[0] != 0 || hw[1] != 0 || hw[2] != 0 {
		t.Fatalf("new topic's high watermarks = %v, want 3 partitions at 0", hw)
	}

	var msgs []kafka.Message
	for i := range 7 {
		msgs = append(msgs, kafka.Message{Partition: 2, Key: []byte("same-key"), Value: []byte(fmt.Sprint(i))})
	}
	msgs = append(msgs, kafka.Message{Partition: 0, Key: []byte("same-key"), Value: []byte("p0")})
	k.Produce(t, topic, msgs...)

	hw := k.HighWatermarks(t, topic)
	if want := map[int]int64{0: 1, 1: 0, 2: 7}; fmt.Sprint(hw) != fmt.Sprint(want) {
		t.Fatalf("high watermarks = %v, want %v", hw, want)
	}

	// Partition 2 holds the records in the order given.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: k.Brokers, Topic: topic, Partition: 2, MaxWait: 50 * time.Millisecond})
	defer r.Close()
	for i := range 7 {
		m, err := r.ReadMessage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if m.Offset != int64(i) || string(m.Value) != fmt.Sprint(i) {
			t.Fatalf("partition 2 offset %d holds %q, want offset %d value %d", m.Offset, m.Value, i, i)
		}
	}
}

func TestBuildBinaryAndProcess(t *testing.T) {
	t.Parallel()
	const pkg = "github.com/kfn-dev/kfn/runtime/kfntest/testdata/sleeper"
	bin := BuildBinary(t, pkg)
	start := time.Now()
	if again := BuildBinary(t, pkg); again != bin {
		t.Fatalf("second BuildBinary gave %s, want the cached %s", again, bin)
	}
	if d := time.Since(start); d > 100*time.Millisecond {
		t.Errorf("cached BuildBinary took %s", d)
	}

	p := StartProcess(t, exec.Command(bin))
	waitFor(t, 10*time.Second, func() bool { return strings.Contains(p.LogTail(5), "ready") })

	p.Pause()
	waitFor(t, 5*time.Second, func() bool { return procState(t, p.Cmd.Process.Pid) == "T" })
	p.Resume()
	waitFor(t, 5*time.Second, func() bool { return procState(t, p.Cmd.Process.Pid) != "T" })

	p.Stop()
	if err := p.ExitErr(); err != nil {
		t.Errorf("sleeper exit after SIGTERM: %v (want status 0)\n%s", err, p.LogTail(5))
	}

	killed := StartProcess(t, exec.Command(bin))
	killed.Kill()
	var exitErr *exec.ExitError
	if err := killed.ExitErr(); !errors.As(err, &exitErr) || exitErr.ProcessState.String() != "signal: killed" {
		t.Errorf("exit after Kill = %v, want signal: killed", err)
	}
}

func TestNATSProcessKeepsJetStreamAcrossRestarts(t *testing.T) {
	t.Parallel()
	srv := NATSProcess(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	bucket := Name(t, "kv")
	put := func(key, val string) {
		t.Helper()
		nc, err := nats.Connect(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		js, _ := jetstream.New(nc)
		kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := kv.Put(ctx, key, []byte(val)); err != nil {
			t.Fatal(err)
		}
	}
	get := func(key string) string {
		t.Helper()
		nc, err := nats.Connect(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		js, _ := jetstream.New(nc)
		kv, err := js.KeyValue(ctx, bucket)
		if err != nil {
			t.Fatalf("bucket %s after restart: %v", bucket, err)
		}
		e, err := kv.Get(ctx, key)
		if err != nil {
			t.Fatalf("key %s after restart: %v", key, err)
		}
		return string(e.Value())
	}

	put("a", "1")
	srv.Stop()
	if _, err := nats.Connect(srv.URL, nats.Timeout(time.Second)); err == nil {
		t.Fatal("connected to a stopped server")
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	if got := get("a"); got != "1" {
		t.Fatalf("after Stop/Start a = %q, want 1", got)
	}

	put("b", "2")
	srv.Kill()
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	if got := get("b"); got != "2" {
		t.Fatalf("after Kill/Start b = %q, want 2", got)
	}
	if err := srv.Start(); err == nil {
		t.Error("Start of a running server succeeded")
	}
}

func waitFor(t *testing.T, limit time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %s", limit)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// procState is the one-letter state of pid from /proc (T = stopped).
func procState(t *testing.T, pid int) string {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Skipf("no /proc: %v", err)
	}
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 >= len(s) {
		t.Fatalf("cannot parse /proc/%d/stat: %q", pid, s)
	}
	return s[i+2 : i+3]
}
