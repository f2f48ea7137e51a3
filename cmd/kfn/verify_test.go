package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// kfn verify exits 0 on a clean function with the report of the shared
// contract (--json: one object, all six kinds of violation present), 1
// with the violation's example once an effect is deleted, and 2 with a
// message naming the setting on bad input or a service that does not
// answer.
func TestVerifyExitCodesAndJSON(t *testing.T) {
	db := kfntest.Postgres(t)
	k := kfntest.Kafka(t)
	topic := k.CreateTopic(t, 2)
	ctx := context.Background()
	fn := runtime.Function{
		Name: "counter", Topic: topic,
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS applied (topic text, part int, off bigint)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, _ *runtime.Events) error {
			_, err := tx.Exec(ctx, `INSERT INTO applied VALUES ($1, $2, $3)`, rec.Topic, rec.Partition, rec.Offset)
			return err
		},
	}
	msgs := make([]kafka.Message, 20)
	for i := range msgs {
		msgs[i] = kafka.Message{Partition: i % 2, Value: []byte(fmt.Sprint(i))}
	}
	k.Produce(t, topic, msgs...)
	w, err := worker.New(ctx, runtime.Config{
		KafkaBrokers: k.Brokers, DatabaseURL: db.URL, NATSURL: kfntest.NATSURL(t), WorkerID: "worker-1",
		LeaseBucket: kfntest.Name(t, "leases"), BatchWait: 5 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})),
	}, fn)
	if err != nil {
		t.Fatal(err)
	}
	stop := kfntest.Background(t, "worker", w.Run)
	waitFor(t, "every record applied", func() bool {
		var n int
		return db.Pool.QueryRow(ctx, `SELECT count(*) FROM kfn.inbox`).Scan(&n) == nil && n == len(msgs)
	})
	stop()

	base := []string{"verify", "--database-url", db.URL, "--kafka-brokers", strings.Join(k.Brokers, ","), "--function", "counter", "--topic", topic,
		"--effects-sql", "SELECT topic, part, off FROM applied"}
	type violation struct {
		Count    *int64    `json:"count"`
		Examples *[]string `json:"examples"`
	}
	var rep struct {
		Function   string               `json:"function"`
		Source     string               `json:"source"`
		Cut        map[string]any       `json:"cut"`
		Checked    map[string]int64     `json:"checked"`
		OK         *bool                `json:"ok"`
		Violations map[string]violation `json:"violations"`
		Seconds    *float64             `json:"seconds"`
	}
	verifyJSON := func(wantCode int) {
		t.Helper()
		code, out, stderr := kfn(t, append(cloneArgs(base), "--json")...)
		rep.Violations = nil
		if code != wantCode || json.Unmarshal([]byte(out), &rep) != nil {
			t.Fatalf("kfn verify --json: exit %d (want %d), out %q, err %q", code, wantCode, out, stderr)
		}
		if rep.Function != "counter" || rep.Source != "kafka topic "+topic || rep.Cut["statement"] == nil || rep.OK == nil || rep.Seconds == nil ||
			rep.Checked["records"] != 20 || rep.Checked["effects"] == 0 || len(rep.Violations) != 6 {
			t.Errorf("kfn verify --json = %s; want the contract's shape, 20 records checked", out)
		}
		for _, kind := range []string{"lost", "duplicated", "unexpected", "fenced_but_committed", "unpublished", "out_of_order"} {
			if v := rep.Violations[kind]; v.Count == nil || v.Examples == nil {
				t.Errorf("violations.%s = %+v; want a count and examples", kind, v)
			}
		}
	}
	verifyJSON(0)
	if !*rep.OK {
		t.Errorf("clean run: ok = %v", *rep.OK)
	}
	code, out, stderr := kfn(t, base...)
	t.Logf("$ kfn verify\n%s", out)
	if code != 0 || !strings.Contains(out, "OK: no violation") || !strings.Contains(stderr, "the events are not checked") {
		t.Errorf("kfn verify (table): exit %d, out %q, err %q; want 0, OK, and a note that the events are not checked", code, out, stderr)
	}

	if _, err := db.Pool.Exec(ctx, `DELETE FROM applied WHERE part = 1 AND off = 2`); err != nil {
		t.Fatal(err)
	}
	verifyJSON(1)
	if lost := rep.Violations["lost"]; *rep.OK || *lost.Count != 1 || len(*lost.Examples) != 1 || !strings.Contains((*lost.Examples)[0], "1@2 has no effect") {
		t.Errorf("after deleting an effect: ok %v, lost %+v; want 1 lost, 1@2", *rep.OK, lost)
	}
	code, out, _ = kfn(t, base...)
	if code != 1 || !strings.Contains(out, "FAILED: 1 violations") {
		t.Errorf("kfn verify (table) with a lost record: exit %d, out %q; want 1, FAILED", code, out)
	}
	// A range holding the lost record finds it; one just past it does
	// not, and says which offsets it checked.
	code, out, stderr = kfn(t, append(cloneArgs(base), "--partitions", "1", "--from", "2", "--to", "3")...)
	if code != 1 || !strings.Contains(out, "1@2 has no effect") || !strings.Contains(out, "range:    partitions 1 from 2 to 3 (only these records are checked)") {
		t.Errorf("kfn verify --partitions 1 --from 2 --to 3: exit %d, out %q, err %q; want 1, the lost 1@2 and the range", code, out, stderr)
	}
	code, out, stderr = kfn(t, append(cloneArgs(base), "--partitions", "1", "--from", "3", "--json")...)
	var ranged struct {
		OK  bool `json:"ok"`
		Cut struct {
			Range struct {
				Partitions []int32 `json:"partitions"`
				From       string  `json:"from"`
			} `json:"range"`
			Partitions []struct {
				Partition    int32 `json:"partition"`
				CheckedFrom  int64 `json:"checked_from"`
				CheckedBelow int64 `json:"checked_below"`
			} `json:"partitions"`
		} `json:"cut"`
	}
	if err := json.Unmarshal([]byte(out), &ranged); code != 0 || err != nil || !ranged.OK || ranged.Cut.Range.From != "3" || !slices.Equal(ranged.Cut.Range.Partitions, []int32{1}) ||
		len(ranged.Cut.Partitions) != 1 || ranged.Cut.Partitions[0].CheckedFrom != 3 || ranged.Cut.Partitions[0].CheckedBelow != 10 {
		t.Errorf("kfn verify --partitions 1 --from 3 --json: exit %d, out %q, err %q; want 0 and partition 1 checked over [3, 10)", code, out, stderr)
	}

	// A NATS-triggered function's lanes, as its first claim records them.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO kfn.subject_lanes (consumer, subject, lanes, changed_at) VALUES ('booker', 'counted.accepted', 1, now())`); err != nil {
		t.Fatal(err)
	}
	replace := func(flag, value string) []string {
		args := cloneArgs(base)
		for i := range args {
			if args[i] == flag {
				args[i+1] = value
			}
		}
		return args
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"unknown function", replace("--function", "nosuch"), `--function: no function "nosuch" in this database`},
		{"wrong topic", replace("--topic", "other"), `--topic: function "counter" has no cursor on topic "other"`},
		{"bad SQL", replace("--effects-sql", "SELECT nope FROM nowhere"), `--effects-sql: the query fails`},
		{"SQL of no shape", replace("--effects-sql", "SELECT 1, 2, 3, 4"), `--effects-sql: the query returns 4 columns`},
		{"no topic", base[:len(base)-4], "--topic is required"},
		{"Postgres down", replace("--database-url", "postgres://kfn@127.0.0.1:1/kfn?connect_timeout=2"), "cannot reach Postgres"},
		{"Kafka down", replace("--kafka-brokers", "127.0.0.1:1"), "127.0.0.1:1"},
		{"no Kafka", slices.Delete(cloneArgs(base), 3, 5), "--kafka-brokers: no brokers: " + topic + ` is a Kafka topic of "counter", whose records are read from Kafka (set it or KFN_KAFKA_BROKERS)`},
		{"a bound of no form", append(cloneArgs(base), "--from", "yesterday"), `--from: "yesterday" is neither an offset (1200000), an RFC 3339 time (2026-12-05T03:00:00Z) nor an age (1h: an hour ago) (see kfn verify -h)`},
		{"a bad partition", append(cloneArgs(base), "--partitions", "0,one"), `--partitions: "one" is not a partition id: give ids from 0, separated by commas (0,3,7)`},
		{"a partition the topic does not have", append(cloneArgs(base), "--partitions", "0,5"), "--partitions: topic " + topic + " has no partition 5: its partitions are 0-1"},
		{"from above to", append(cloneArgs(base), "--from", "8", "--to", "4"), "--from: 8 is not below --to 4: the range [from, to) would be empty"},
		{"a range past the records", append(cloneArgs(base), "--from", "100"), "--from: the range holds no record of " + topic + " that Kafka holds: Kafka holds partition 0 offsets [0, 10), partition 1 offsets [0, 10)"},
		{"a counting shape over a range", append(replace("--effects-sql", "SELECT count(*) FROM applied"), "--to", "5"), "--effects-sql: the query returns counts, which cannot be compared over a range"},
		{"a NATS-triggered function without NATS", []string{"verify", "--database-url", db.URL, "--function", "booker", "--topic", "counted.accepted"},
			`--nats-url: counted.accepted is the NATS subject of "booker", a NATS-triggered function, whose events are read from the event stream: give the NATS server (set it or KFN_NATS_URL)`},
	} {
		start := time.Now()
		code, out, stderr := kfn(t, tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) || out != "" {
			t.Errorf("%s: exit %d, out %q, err %q; want exit 2 saying %q", tc.name, code, out, stderr, tc.want)
		}
		t.Logf("%s (%s): %s", tc.name, time.Since(start).Round(time.Millisecond), strings.TrimSpace(stderr))
	}
}
