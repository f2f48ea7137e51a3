package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// isolatedFunctions are an orders and a ledger function for the
// per-function roles test, on subjects of the test's own (the NATS server
// is shared by the test binary): orders takes Kafka records, writes
// orders and emits <prefix>.accepted, and dead-letters a value that
// is not JSON; ledger takes those events, writes ledger_entries and emits
// <prefix>.captured, and dead-letters the order "poison" until
// iso_ledger_allow lets it through.
func isolatedFunctions(topic, prefix string) (ordersFn, ledgerFn runtime.Function) {
	accepted, captured := prefix+".accepted", prefix+".captured"
	ordersFn = runtime.Function{
		Name: "orders", Topic: topic, Emits: []string{accepted},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (order_id text PRIMARY KEY)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			var o struct {
				ID string `json:"order_id"`
			}
			if err := json.Unmarshal(rec.Value, &o); err != nil {
				return runtime.Permanent(err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO orders (order_id) VALUES ($1)`, o.ID); err != nil {
				return err
			}
			out.Emit(runtime.Event{Subject: accepted, Key: o.ID, Data: rec.Value})
			return nil
		},
	}
	ledgerFn = runtime.Function{
		Name: "ledger", Subject: accepted, Emits: []string{captured},
		Setup: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `
CREATE TABLE IF NOT EXISTS ledger_entries (id bigserial PRIMARY KEY, order_id text NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS iso_ledger_allow (order_id text PRIMARY KEY)`)
			return err
		},
		Handler: func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			var o struct {
				ID string `json:"order_id"`
			}
			if err := json.Unmarshal(rec.Value, &o); err != nil {
				return runtime.Permanent(err)
			}
			if o.ID == "poison" {
				var allowed bool
				if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM iso_ledger_allow WHERE order_id = $1)`, o.ID).Scan(&allowed); err != nil {
					return err
				}
				if !allowed {
					return runtime.Permanent(errors.New("order poison is not allowed yet"))
				}
			}
			if _, err := tx.Exec(ctx, `INSERT INTO ledger_entries (order_id) VALUES ($1)`, o.ID); err != nil {
				return err
			}
			out.Emit(runtime.Event{Subject: captured, Key: o.ID, Data: rec.Value})
			return nil
		},
	}
	return ordersFn, ledgerFn
}

// refusal is one thing the orders role tries on the ledger's rows or
// tables, and how Postgres refused it.
type refusal struct {
	action, table, sql string
	// What refuses it: an SQLSTATE the statement must fail with, or ""
	// when it must succeed and touch (or see) no row.
	code string
}

// TestEachFunctionRunsUnderItsOwnRole gives the orders and the ledger
// function a Postgres role each (kfn migrate grants --apply, as the
// migrator), runs each function's workers under its own role without a
// relay, and kfn relay under a role bound to every function: orders
// applies records and dead-letters one, ledger applies the events orders
// emitted and dead-letters one, both letters are retried (the ledger's
// applies, the orders' fails again), and every outbox row is relayed. The
// orders role then tries to read, change and delete the ledger's cursor,
// inbox, event inbox, outbox, dead letters, parked keys and audit rows, to
// write the ledger's tables, to bind itself to the ledger and to end a
// ledger session: each is refused. The operator (kfn_operator, bound to
// every function by the migration) sees both functions in kfn status and
// kfn dlq list.
func TestEachFunctionRunsUnderItsOwnRole(t *testing.T) {
	pg := startTLSPostgres(t)
	k := kfntest.Kafka(t)
	natsURL := kfntest.NATSURL(t)
	bucket, stream := kfntest.Name(t, "leases"), kfntest.Name(t, "events")
	prefix := strings.ReplaceAll(kfntest.Name(t, "iso"), "-", "_")
	topic := k.CreateTopic(t, 1)
	ordersFn, ledgerFn := isolatedFunctions(topic, prefix)
	ledgerFn.Stream = stream
	ctx := context.Background()

	if _, err := pg.admin.Exec(ctx, readmeGrants(t)); err != nil {
		t.Fatalf("the documented GRANTs: %v", err)
	}
	if _, err := pg.admin.Exec(ctx, `CREATE ROLE kfn_fn_orders LOGIN; CREATE ROLE kfn_fn_ledger LOGIN; CREATE ROLE kfn_relay LOGIN`); err != nil {
		t.Fatal(err)
	}
	migrator := pg.url("kfn_migrator", "m-secret", "localhost", pg.caFile)
	op := pg.url("kfn_operator", "o-secret", "localhost", pg.caFile)
	ordersURL := pg.url("kfn_fn_orders", "w-secret", "localhost", pg.caFile)
	ledgerURL := pg.url("kfn_fn_ledger", "w-secret", "localhost", pg.caFile)
	relayURL := pg.url("kfn_relay", "r-secret", "localhost", pg.caFile)

	subjects := prefix + ".accepted," + prefix + ".captured"
	if code, out, stderr := kfn(t, "migrate", "--database-url", migrator, "--nats", "--nats-url", natsURL,
		"--lease-bucket", bucket, "--lease-ttl", "2s", "--event-stream", stream, "--subjects", subjects); code != 0 {
		t.Fatalf("kfn migrate as kfn_migrator: exit %d, out %q, err %q", code, out, stderr)
	}
	for _, fn := range []runtime.Function{ordersFn, ledgerFn} {
		var stderr bytes.Buffer
		if code := worker.Main(fn, []string{"migrate", "--database-url", migrator}, &stderr); code != 0 {
			t.Fatalf("%s migrate as kfn_migrator: exit %d, %s", fn.Name, code, stderr.String())
		}
	}
	for _, g := range [][]string{
		{"--function", "orders", "--role", "kfn_fn_orders", "--tables", "orders"},
		{"--function", "ledger", "--role", "kfn_fn_ledger", "--tables", "ledger_entries,iso_ledger_allow"},
		{"--function", "*", "--role", "kfn_relay"},
	} {
		args := append([]string{"migrate", "grants", "--apply", "--database-url", migrator}, g...)
		if code, out, stderr := kfn(t, args...); code != 0 || !strings.Contains(out, "may now run function") {
			t.Fatalf("kfn %s: exit %d, out %q, err %q", strings.Join(args, " "), code, out, stderr)
		}
	}
	// Only the owner may bind: the shared worker role may not.
	if code, _, stderr := kfn(t, "migrate", "grants", "--apply", "--database-url", pg.url("kfn_worker", "w", "localhost", pg.caFile),
		"--function", "ledger", "--role", "kfn_fn_orders"); code != 1 || !strings.Contains(stderr, "permission denied for table function_roles") {
		t.Errorf("kfn migrate grants --apply as kfn_worker: exit %d, %s; want exit 1, permission denied for table function_roles", code, stderr)
	}

	// A worker under a role not bound to its function, or with a relay
	// under a role bound to some functions only, is refused at start.
	base := runtime.Config{
		KafkaBrokers: k.Brokers, NATSURL: natsURL, LeaseBucket: bucket, EventStream: stream,
		LeaseTTL: 2 * time.Second, LeaseRenew: 500 * time.Millisecond, SkipSetup: true,
	}
	wrong := base
	wrong.DatabaseURL, wrong.NoRelay = ordersURL, true
	if _, err := worker.New(ctx, wrong, ledgerFn); err == nil || !strings.Contains(err.Error(), `the role "kfn_fn_orders" is not bound to function ledger`) {
		t.Errorf("a ledger worker as kfn_fn_orders: %v; want a refusal that names the missing binding", err)
	} else {
		t.Logf("a ledger worker as kfn_fn_orders: %v", err)
	}
	withRelay := base
	withRelay.DatabaseURL = ordersURL
	if _, err := worker.New(ctx, withRelay, ordersFn); err == nil || !strings.Contains(err.Error(), "--no-relay (KFN_NO_RELAY)") {
		t.Errorf("an orders worker with a relay as kfn_fn_orders: %v; want a refusal that asks for --no-relay", err)
	} else {
		t.Logf("an orders worker with a relay as kfn_fn_orders: %v", err)
	}

	// The workers, each under its own role, without a relay; the relay
	// under kfn_relay.
	const n = 10
	msgs := []kafka.Message{{Partition: 0, Key: []byte("bad"), Value: []byte("{not json")}}
	for i := 1; i <= n; i++ {
		msgs = append(msgs, kafka.Message{Partition: 0, Key: []byte(fmt.Sprint(i)), Value: fmt.Appendf(nil, `{"order_id":"o-%d"}`, i)})
	}
	msgs = append(msgs, kafka.Message{Partition: 0, Key: []byte("poison"), Value: []byte(`{"order_id":"poison"}`)})
	k.Produce(t, topic, msgs...)
	for _, w := range []struct {
		fn  runtime.Function
		url string
	}{{ordersFn, ordersURL}, {ledgerFn, ledgerURL}} {
		cfg := base
		cfg.DatabaseURL, cfg.WorkerID, cfg.NoRelay = w.url, w.fn.Name+"-worker", true
		wk, err := worker.New(ctx, cfg, w.fn)
		if err != nil {
			t.Fatalf("a worker of %s under its own role: %v", w.fn.Name, err)
		}
		kfntest.Background(t, w.fn.Name+" worker", wk.Run)
	}
	var relayOut, relayErr bytes.Buffer
	stopRelay := kfntest.Background(t, "kfn relay", func(ctx context.Context) error {
		code := run(ctx, []string{"relay", "--database-url", relayURL, "--nats-url", natsURL, "--lease-bucket", bucket,
			"--event-stream", stream, "--subjects", subjects, "--lease-ttl", "2s", "--lease-renew", "500ms", "--worker-id", "relay-1"}, &relayOut, &relayErr)
		if code != 0 && ctx.Err() == nil {
			return fmt.Errorf("kfn relay as kfn_relay: exit %d, %s", code, relayErr.String())
		}
		return nil
	})

	count := func(sql string, args ...any) int {
		t.Helper()
		var c int
		if err := pg.admin.QueryRow(ctx, sql, args...).Scan(&c); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return c
	}
	waitFor(t, "orders to apply every order and the ledger to book all but poison", func() bool {
		return count(`SELECT count(*) FROM orders`) == n+1 && count(`SELECT count(*) FROM ledger_entries`) == n &&
			count(`SELECT count(*) FROM kfn.dead_letters`) == 2
	})
	if got := count(`SELECT count(*) FROM kfn.dead_letters WHERE consumer = 'orders' AND "offset" = 0`); got != 1 {
		t.Errorf("orders' dead letter for offset 0: %d rows, want 1", got)
	}
	waitFor(t, "kfn relay (as kfn_relay) to relay every outbox row", func() bool {
		return count(`SELECT count(*) FROM kfn.outbox`) == 0
	})

	// Retries: the ledger's letter applies once allowed; the orders'
	// letter (not JSON) fails again. Each is applied by its function's
	// lane, under its function's role.
	if _, err := pg.admin.Exec(ctx, `INSERT INTO iso_ledger_allow VALUES ('poison')`); err != nil {
		t.Fatal(err)
	}
	if code, out, stderr := kfn(t, "dlq", "retry", "--database-url", op, "--function", "ledger", "--reason", "isolation test", "--wait", "--timeout", "30s"); code != 0 {
		t.Errorf("kfn dlq retry --function ledger as kfn_operator: exit %d, out %q, err %q; want it applied", code, out, stderr)
	}
	if code, out, stderr := kfn(t, "dlq", "retry", "--database-url", op, "--function", "orders", "--reason", "isolation test", "--wait", "--timeout", "30s"); code != 1 || !strings.Contains(out+stderr, "fail") {
		t.Errorf("kfn dlq retry --function orders as kfn_operator: exit %d, out %q, err %q; want it to fail again (exit 1)", code, out, stderr)
	}
	waitFor(t, "the ledger to book poison and the relay to send its event", func() bool {
		return count(`SELECT count(*) FROM ledger_entries`) == n+1 && count(`SELECT count(*) FROM kfn.outbox`) == 0
	})
	if got := count(`SELECT count(*) FROM kfn.audit_log WHERE action = 'dlq_retry_applied' AND consumer = 'ledger'`); got != 1 {
		t.Errorf("audit rows of the ledger's applied retry: %d, want 1", got)
	}
	if got := count(`SELECT count(*) FROM kfn.audit_log WHERE action = 'dlq_retry_failed' AND consumer = 'orders'`); got != 1 {
		t.Errorf("audit rows of the orders' failed retry: %d, want 1", got)
	}
	js, closeNATS, err := connectJetStream(natsURL, "isolation-test")
	if err != nil {
		t.Fatal(err)
	}
	defer closeNATS()
	es, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := es.CachedInfo().State.Msgs, uint64(2*n+2); got != want {
		t.Errorf("the event stream holds %d messages, want %d (orders' %d accepted, ledger's %d captured)", got, want, n+1, n+1)
	}

	// The operator sees both functions.
	code, out, errOut := kfn(t, "status", "--database-url", op, "--kafka-brokers", strings.Join(k.Brokers, ","), "--nats-url", natsURL, "--lease-bucket", bucket, "--json")
	var parts []operator.PartitionStatus
	if err := json.Unmarshal([]byte(out), &parts); code != 0 || err != nil {
		t.Fatalf("kfn status as kfn_operator: exit %d, out %q, err %q", code, out, errOut)
	}
	seen := map[string]bool{}
	for _, p := range parts {
		seen[p.Function] = true
	}
	if !seen["orders"] || !seen["ledger"] {
		t.Errorf("kfn status as kfn_operator shows functions %v, want orders and ledger", seen)
	}

	// The refusals. Rows of the ledger for every table first (the ones
	// the run left, and the rest written as the owner), then the orders
	// role's attempts.
	stopRelay()
	seed := `
INSERT INTO kfn.lanes (consumer, topic, partition) VALUES ('ledger', 'seed', 0);
INSERT INTO kfn.inbox (lane, "offset", epoch) SELECT id, 0, 1 FROM kfn.lanes WHERE consumer = 'ledger' AND topic = 'seed';
INSERT INTO kfn.dead_letters (consumer, topic, partition, "offset", reason, error, attempts) VALUES ('ledger', 'seed', 0, 0, 'permanent', 'seeded', 1);
INSERT INTO kfn.parked_keys (consumer, topic, partition, record_key, blocking_offset) VALUES ('ledger', 'seed', 0, 'k', 0);
INSERT INTO kfn.outbox (event_id, subject, event_type, event_key, shard, data, source, source_topic, source_partition, source_offset)
     VALUES ('seeded-ledger-event', 'seed', 't', 'k', 0, 'x', 'ledger', 'seed', 0, 0)`
	if _, err := pg.admin.Exec(ctx, seed); err != nil {
		t.Fatal(err)
	}
	// The ledger's rows of each table: an inbox row by its lane's id, which
	// the orders role could know (the ids are small integers) although it
	// cannot read the ledger's lanes.
	var ledgerLane int
	if err := pg.admin.QueryRow(ctx, `SELECT id FROM kfn.lanes WHERE consumer = 'ledger' AND topic = 'seed'`).Scan(&ledgerLane); err != nil {
		t.Fatal(err)
	}
	ledgerRows := map[string]string{
		"kfn.cursors": "consumer = 'ledger'", "kfn.lanes": "consumer = 'ledger'", "kfn.inbox": fmt.Sprintf("lane = %d", ledgerLane),
		"kfn.event_inbox": "consumer = 'ledger'", "kfn.dead_letters": "consumer = 'ledger'",
		"kfn.parked_keys": "consumer = 'ledger'", "kfn.audit_log": "consumer = 'ledger'", "kfn.outbox": "source = 'ledger'",
	}
	for table, where := range ledgerRows {
		if c := count(`SELECT count(*) FROM ` + table + ` WHERE ` + where); c == 0 {
			t.Fatalf("%s has no row of the ledger to try the orders role on", table)
		}
	}
	cursorOf := func() string {
		t.Helper()
		var c string
		if err := pg.admin.QueryRow(ctx, `SELECT string_agg(format('%s/%s/%s@%s', topic, partition, next_offset, epoch), ' ' ORDER BY topic, partition) FROM kfn.cursors WHERE consumer = 'ledger'`).Scan(&c); err != nil {
			t.Fatal(err)
		}
		return c
	}
	ledgerCursor := cursorOf()
	asOrders, err := pgxpool.New(ctx, ordersURL)
	if err != nil {
		t.Fatal(err)
	}
	defer asOrders.Close()
	asLedger, err := pgxpool.New(ctx, ledgerURL)
	if err != nil {
		t.Fatal(err)
	}
	defer asLedger.Close()
	var ledgerPID int
	if err := asLedger.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&ledgerPID); err != nil {
		t.Fatal(err)
	}
	refusals := []refusal{}
	for _, table := range []string{"kfn.cursors", "kfn.lanes", "kfn.inbox", "kfn.event_inbox", "kfn.dead_letters", "kfn.parked_keys", "kfn.audit_log", "kfn.outbox"} {
		refusals = append(refusals, refusal{"read", table, `SELECT 1 FROM ` + table + ` WHERE ` + ledgerRows[table], ""})
	}
	for _, table := range []string{"kfn.cursors", "kfn.inbox", "kfn.event_inbox", "kfn.dead_letters", "kfn.parked_keys"} {
		set := "consumer = consumer"
		if table == "kfn.inbox" {
			set = "epoch = epoch"
		}
		refusals = append(refusals,
			refusal{"update", table, `UPDATE ` + table + ` SET ` + set + ` WHERE ` + ledgerRows[table], ""},
			refusal{"delete", table, `DELETE FROM ` + table + ` WHERE ` + ledgerRows[table], ""})
	}
	refusals = append(refusals,
		refusal{"update", "kfn.cursors", `UPDATE kfn.cursors SET epoch = epoch + 1000, next_offset = 0 WHERE consumer = 'ledger'`, ""},
		refusal{"update", "kfn.audit_log", `UPDATE kfn.audit_log SET actor = 'x' WHERE consumer = 'ledger'`, "42501"},
		refusal{"delete", "kfn.audit_log", `DELETE FROM kfn.audit_log WHERE consumer = 'ledger'`, "42501"},
		refusal{"update", "kfn.outbox", `UPDATE kfn.outbox SET data = 'y' WHERE source = 'ledger'`, "42501"},
		refusal{"delete", "kfn.outbox", `DELETE FROM kfn.outbox WHERE source = 'ledger'`, "42501"},
		refusal{"truncate", "kfn.inbox", `TRUNCATE kfn.inbox`, "42501"},
		refusal{"insert", "kfn.cursors", `INSERT INTO kfn.cursors (consumer, topic, partition, next_offset, high_water, epoch, owner) VALUES ('ledger', 'x', 9, 0, 0, 1, 'o')`, "42501"},
		refusal{"insert", "kfn.lanes", `INSERT INTO kfn.lanes (consumer, topic, partition) VALUES ('ledger', 'seed', 1)`, "42501"},
		refusal{"insert", "kfn.inbox", fmt.Sprintf(`INSERT INTO kfn.inbox (lane, "offset", epoch) VALUES (%d, 99, 1)`, ledgerLane), "42501"},
		refusal{"insert", "kfn.event_inbox", `INSERT INTO kfn.event_inbox (consumer, event_id, subject, stream_seq, epoch) VALUES ('ledger', 'e', 's', 1, 1)`, "42501"},
		refusal{"insert", "kfn.dead_letters", `INSERT INTO kfn.dead_letters (consumer, topic, partition, "offset", reason, error, attempts) VALUES ('ledger', 'seed', 0, 99, 'permanent', 'x', 1)`, "42501"},
		refusal{"insert", "kfn.parked_keys", `INSERT INTO kfn.parked_keys (consumer, topic, partition, record_key, blocking_offset) VALUES ('ledger', 'seed', 0, 'k2', 1)`, "42501"},
		refusal{"insert", "kfn.outbox", `INSERT INTO kfn.outbox (event_id, subject, event_type, event_key, shard, data, source, source_topic, source_partition, source_offset) VALUES ('forged', 's', 't', 'k', 0, 'x', 'ledger', 't', 0, 0)`, "42501"},
		refusal{"insert", "kfn.audit_log", `INSERT INTO kfn.audit_log (actor, action, consumer, topic, partition) VALUES ('x', 'replay', 'ledger', 't', 0)`, "42501"},
		refusal{"move own row to the ledger", "kfn.cursors", `UPDATE kfn.cursors SET consumer = 'ledger', topic = 'moved' WHERE consumer = 'orders'`, "42501"},
		refusal{"bind itself to the ledger", "kfn.function_roles", `INSERT INTO kfn.function_roles (role_name, consumer) VALUES (current_user, 'ledger')`, "42501"},
		refusal{"widen its binding", "kfn.function_roles", `UPDATE kfn.function_roles SET consumer = '*' WHERE role_name = current_user`, "42501"},
		refusal{"turn off row-level security", "kfn.cursors", `ALTER TABLE kfn.cursors DISABLE ROW LEVEL SECURITY`, "42501"},
		refusal{"become the ledger's role", "-", `SET ROLE kfn_fn_ledger`, "42501"},
		refusal{"end a ledger session", "-", fmt.Sprintf(`SELECT pg_terminate_backend(%d)`, ledgerPID), "42501"},
		refusal{"read", "ledger_entries", `SELECT 1 FROM ledger_entries`, "42501"},
		refusal{"insert", "ledger_entries", `INSERT INTO ledger_entries (order_id) VALUES ('forged')`, "42501"},
		refusal{"update", "ledger_entries", `UPDATE ledger_entries SET order_id = order_id`, "42501"},
		refusal{"delete", "ledger_entries", `DELETE FROM ledger_entries`, "42501"},
		refusal{"insert", "iso_ledger_allow", `INSERT INTO iso_ledger_allow VALUES ('x')`, "42501"},
	)
	var table strings.Builder
	fmt.Fprintf(&table, "\n| action | table | refused how |\n|---|---|---|\n")
	for _, r := range refusals {
		how, err := tryAs(ctx, asOrders, r.sql)
		switch {
		case r.code == "" && err != nil:
			t.Errorf("as kfn_fn_orders, %s: %v; want no error and no row", r.sql, err)
		case r.code != "" && err == nil:
			t.Errorf("as kfn_fn_orders, %s: succeeded (%s); want SQLSTATE %s", r.sql, how, r.code)
		case r.code != "" && !hasCode(err, r.code):
			t.Errorf("as kfn_fn_orders, %s: %v; want SQLSTATE %s", r.sql, err, r.code)
		case r.code == "" && how != "0 rows":
			t.Errorf("as kfn_fn_orders, %s: %s; want 0 rows", r.sql, how)
		}
		if err != nil {
			how = err.Error()
		}
		fmt.Fprintf(&table, "| %s | %s | %s |\n", r.action, r.table, how)
	}
	t.Log(table.String())
	// Nothing of the ledger's changed.
	if got := cursorOf(); got != ledgerCursor {
		t.Errorf("the ledger's cursors went from %s to %s under the orders role", ledgerCursor, got)
	}
	if got := count(`SELECT count(*) FROM ledger_entries`); got != n+1 {
		t.Errorf("ledger_entries has %d rows after the orders role's attempts, want %d", got, n+1)
	}
	// The orders role still sees its own rows.
	var own int
	if err := asOrders.QueryRow(ctx, `SELECT count(*) FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = 'orders'`).Scan(&own); err != nil || own != n+2 {
		t.Errorf("the orders role sees %d of its own inbox rows (%v), want %d", own, err, n+2)
	}

	// The operator still sees every function's dead letters.
	code, out, errOut = kfn(t, "dlq", "list", "--database-url", op)
	if code != 0 || !strings.Contains(out, "orders") || !strings.Contains(out, "ledger") {
		t.Errorf("kfn dlq list as kfn_operator: exit %d, out %q, err %q; want the letters of orders and ledger", code, out, errOut)
	}

	// Retention under the orders role purges the orders' inbox rows and
	// dead letters, and none of the ledger's.
	ledgerBefore := count(`SELECT (SELECT count(*) FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = 'ledger') * 1000000 + (SELECT count(*) FROM kfn.event_inbox WHERE consumer = 'ledger') * 1000 + (SELECT count(*) FROM kfn.dead_letters WHERE consumer = 'ledger')`)
	purger := base
	purger.DatabaseURL, purger.WorkerID, purger.NoRelay = ordersURL, "orders-retention", true
	purger.InboxRetention, purger.DeadLetterRetention = time.Second, time.Second
	wk, err := worker.New(ctx, purger, ordersFn)
	if err != nil {
		t.Fatalf("an orders worker with a retention of 1s: %v", err)
	}
	kfntest.Background(t, "orders retention worker", wk.Run)
	waitFor(t, "retention (as kfn_fn_orders) to purge the orders' inbox rows and dead letters", func() bool {
		return count(`SELECT count(*) FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = 'orders'`) == 0 && count(`SELECT count(*) FROM kfn.dead_letters WHERE consumer = 'orders'`) == 0
	})
	if after := count(`SELECT (SELECT count(*) FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = 'ledger') * 1000000 + (SELECT count(*) FROM kfn.event_inbox WHERE consumer = 'ledger') * 1000 + (SELECT count(*) FROM kfn.dead_letters WHERE consumer = 'ledger')`); after != ledgerBefore {
		t.Errorf("the ledger's inbox, event inbox and dead letters went from %d to %d (inbox×10⁶ + events×10³ + letters) under the orders role's retention", ledgerBefore, after)
	}
}

// tryAs runs sql in a transaction of its own that it rolls back, and says
// what it did: "N rows", or the error.
func tryAs(ctx context.Context, pool *pgxpool.Pool, sql string) (string, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // rolled back on purpose
	rows, err := tx.Query(ctx, sql)
	if err != nil {
		return "", err
	}
	n := 0
	for rows.Next() {
		n++
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return "", err
	}
	if tag := rows.CommandTag(); !tag.Select() {
		n = int(tag.RowsAffected())
	}
	return fmt.Sprintf("%d rows", n), nil
}

func hasCode(err error, code string) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == code
}

// TestMigrateGrantsPrintsTheSQLForOneFunction checks kfn migrate grants
// without --apply: the grants and the binding, DML on the tables named,
// and the lines to complete when none is; and its usage errors.
func TestMigrateGrantsPrintsTheSQLForOneFunction(t *testing.T) {
	code, out, stderr := kfn(t, "migrate", "grants", "--function", "orders", "--role", "kfn_fn_orders")
	for _, want := range []string{
		`GRANT SELECT, INSERT, UPDATE, DELETE ON kfn.cursors, kfn.inbox, kfn.event_inbox, kfn.dead_letters, kfn.parked_keys, kfn.subject_lanes, kfn.key_lanes TO "kfn_fn_orders";`,
		`GRANT SELECT, INSERT ON kfn.outbox, kfn.audit_log TO "kfn_fn_orders";`,
		`GRANT SELECT, INSERT ON kfn.lanes TO "kfn_fn_orders";`,
		`INSERT INTO kfn.function_roles (role_name, consumer) VALUES ('kfn_fn_orders', 'orders') ON CONFLICT DO NOTHING;`,
		`-- The tables of orders: kfn cannot list what its Setup creates.`,
	} {
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("kfn migrate grants: exit %d, out:\n%s\nerr %q; want %q", code, out, stderr, want)
		}
	}
	if strings.Contains(out, "DELETE ON kfn.outbox") {
		t.Errorf("a function's role may delete outbox rows:\n%s", out)
	}
	code, out, _ = kfn(t, "migrate", "grants", "--function", "o'x", "--role", `r"x`, "--tables", "orders,acct.entries")
	for _, want := range []string{
		`VALUES ('r"x', 'o''x')`,
		`GRANT USAGE ON SCHEMA "acct" TO "r""x";`,
		`GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."orders", "acct"."entries" TO "r""x";`,
	} {
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("kfn migrate grants with quotes and tables: exit %d, out:\n%s\nwant %q", code, out, want)
		}
	}
	if strings.Contains(out, "kfn cannot list") {
		t.Errorf("with --tables, the printout still asks for the tables:\n%s", out)
	}
	code, out, _ = kfn(t, "migrate", "grants", "--function", "*", "--role", "kfn_relay")
	if code != 0 || !strings.Contains(out, `GRANT DELETE ON kfn.outbox TO "kfn_relay";`) || strings.Contains(out, "kfn cannot list") {
		t.Errorf("kfn migrate grants --function '*': exit %d, out:\n%s\nwant DELETE on the outbox (it may relay) and no tables", code, out)
	}
	for _, args := range [][]string{{"--role", "r"}, {"--function", "f"}} {
		if code, _, stderr := kfn(t, append([]string{"migrate", "grants"}, args...)...); code != 2 || !strings.Contains(stderr, "missing --") {
			t.Errorf("kfn migrate grants %q: exit %d, stderr %q; want a usage error", args, code, stderr)
		}
	}
}
