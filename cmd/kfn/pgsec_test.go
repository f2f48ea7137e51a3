package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/functions/orders"
	"github.com/kfn-dev/kfn/internal/devstack"
	"github.com/kfn-dev/kfn/operator"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// tlsPostgres is a throwaway cluster of a test's own with ssl=on, its
// server certificate (for localhost and 127.0.0.1) signed by a CA made for
// the test, and a database named kfn.
type tlsPostgres struct {
	port    int
	caFile  string // the CA that signs the server's certificate
	otherCA string // a CA that does not
	admin   *pgxpool.Pool
}

// startTLSPostgres starts the cluster and stops it when the test ends.
func startTLSPostgres(t *testing.T) *tlsPostgres {
	t.Helper()
	dir := t.TempDir()
	caCert, caKey := newCertificate(t, &x509.Certificate{
		Subject: pkix.Name{CommonName: "kfn test CA"}, IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}, nil, nil)
	other, _ := newCertificate(t, &x509.Certificate{
		Subject: pkix.Name{CommonName: "some other CA"}, IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}, nil, nil)
	srvCert, srvKey := newCertificate(t, &x509.Certificate{
		Subject: pkix.Name{CommonName: "localhost"}, DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, caCert, caKey)
	keyDER, err := x509.MarshalECPrivateKey(srvKey)
	if err != nil {
		t.Fatal(err)
	}
	pg := &tlsPostgres{caFile: filepath.Join(dir, "ca.pem"), otherCA: filepath.Join(dir, "other-ca.pem")}
	writePEM(t, pg.caFile, caCert.Raw)
	writePEM(t, pg.otherCA, other.Raw)

	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cluster, err := devstack.StartPostgres(ctx, devstack.PostgresOptions{
		TLSCert: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srvCert.Raw}),
		TLSKey:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := cluster.Stop(); err != nil {
			t.Errorf("stop postgres: %v", err)
		}
	})
	pg.port = cluster.Port
	admin, err := pgxpool.New(ctx, cluster.URL)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `CREATE DATABASE kfn`); err != nil {
		t.Fatal(err)
	}
	admin.Close()
	// The superuser, in database kfn, without TLS: the test's own view.
	if pg.admin, err = pgxpool.New(ctx, strings.Replace(cluster.URL, "/postgres?", "/kfn?", 1)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.admin.Close)
	return pg
}

// url is a verify-full URL of database kfn for user (with password, which
// the cluster's trust authentication ignores) at host, trusting ca.
func (pg *tlsPostgres) url(user, password, host, ca string) string {
	u := url.URL{Scheme: "postgres", User: url.UserPassword(user, password), Host: fmt.Sprintf("%s:%d", host, pg.port), Path: "/kfn",
		RawQuery: url.Values{"sslmode": {"verify-full"}, "sslrootcert": {ca}}.Encode()}
	return u.String()
}

// sessionsOverTLS counts the sessions named appName and those of them that
// use TLS.
func (pg *tlsPostgres) sessionsOverTLS(t *testing.T, appName string) (all, tls int) {
	t.Helper()
	err := pg.admin.QueryRow(context.Background(), `
SELECT count(*), count(*) FILTER (WHERE s.ssl)
  FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
 WHERE a.application_name = $1`, appName).Scan(&all, &tls)
	if err != nil {
		t.Fatal(err)
	}
	return all, tls
}

// newCertificate makes a key and a certificate from tmpl, valid for a day,
// signed by parent's key, or self-signed when parent is nil.
func newCertificate(t *testing.T, tmpl, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		t.Fatal(err)
	}
	tmpl.SerialNumber, tmpl.NotBefore, tmpl.NotAfter = serial, time.Now().Add(-time.Hour), time.Now().Add(24*time.Hour)
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

func writePEM(t *testing.T, path string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// produceTestOrders writes n valid orders and one that does not decode to
// partition 0 of topic.
func produceTestOrders(t *testing.T, k *kfntest.KafkaCluster, topic string, n int) {
	t.Helper()
	var msgs []kafka.Message
	for i := 1; i <= n; i++ {
		key, value := validOrder(i)
		msgs = append(msgs, kafka.Message{Partition: 0, Key: []byte(key), Value: value})
	}
	msgs = append(msgs, kafka.Message{Partition: 0, Key: []byte("bad"), Value: []byte("{not json")})
	k.Produce(t, topic, msgs...)
}

// TestPostgresVerifyFull runs kfn migrate, a worker and kfn status (with a
// URL and with a keyword/value string) against
// a Postgres that serves TLS, with sslmode=verify-full and the CA that
// signed its certificate, and checks that every session they open is
// encrypted. With a CA that did not sign it, each fails at once, naming
// --database-url (DATABASE_URL), without printing the password.
func TestPostgresVerifyFull(t *testing.T) {
	pg := startTLSPostgres(t)
	k := kfntest.Kafka(t)
	natsURL := kfntest.NATSURL(t)
	topic := k.CreateTopic(t, 1)
	fn := orders.Function()
	fn.Name, fn.Topic = kfntest.Name(t, "orders"), topic
	const password = "tlsPw4Jx8Nsecret"
	byName := pg.url("postgres", password, "localhost", pg.caFile)
	byIP := pg.url("postgres", password, "127.0.0.1", pg.caFile)

	code, out, stderr := kfn(t, "migrate", "--database-url", byName)
	if code != 0 || !strings.Contains(out, "schema is at version") {
		t.Fatalf("kfn migrate over verify-full: exit %d, out %q, err %q", code, out, stderr)
	}
	const n = 20
	produceTestOrders(t, k, topic, n)
	ctx := context.Background()
	w, err := worker.New(ctx, runtime.Config{
		KafkaBrokers: k.Brokers, DatabaseURL: byIP, NATSURL: natsURL, WorkerID: "tls-worker",
		LeaseBucket: kfntest.Name(t, "leases"),
	}, fn)
	if err != nil {
		t.Fatal(err)
	}
	kfntest.Background(t, "worker", w.Run)
	var rows int
	waitFor(t, "the worker to apply every valid order", func() bool {
		return pg.admin.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&rows) == nil && rows == n
	})
	if all, tls := pg.sessionsOverTLS(t, "kfn-worker tls-worker"); all == 0 || tls != all {
		t.Errorf("the worker has %d sessions, %d of them over TLS; want all of them", all, tls)
	}
	waitFor(t, "the cursor to pass every record", func() bool {
		var next int64
		return pg.admin.QueryRow(ctx, `SELECT next_offset FROM kfn.cursors WHERE consumer = $1`, fn.Name).Scan(&next) == nil && next == n+1
	})

	// kfn status, with the URL and with a keyword/value string.
	dsn := fmt.Sprintf("host=localhost port=%d user=postgres password=%s dbname=kfn sslmode=verify-full sslrootcert=%s", pg.port, password, pg.caFile)
	for form, dbURL := range map[string]string{"URL": byName, "keyword/value string": dsn} {
		code, out, stderr = kfn(t, "status", "--database-url", dbURL, "--function", fn.Name, "--json")
		var parts []operator.PartitionStatus
		if code != 0 || json.Unmarshal([]byte(out), &parts) != nil || len(parts) != 1 || parts[0].Cursor != n+1 {
			t.Errorf("kfn status over verify-full, a %s: exit %d, out %q, err %q; want one partition at cursor %d", form, code, out, stderr, n+1)
		}
	}

	// A CA that did not sign the server's certificate.
	untrusted := pg.url("postgres", password, "localhost", pg.otherCA)
	const want = "does not verify: check sslrootcert (the CA that signs the server's certificate) and the host name in --database-url (DATABASE_URL)"
	for _, cmd := range []string{"migrate", "status"} {
		start := time.Now()
		code, out, stderr := kfn(t, cmd, "--database-url", untrusted)
		if code != 1 || !strings.Contains(stderr, want) || !strings.Contains(stderr, "x509") {
			t.Errorf("kfn %s with the wrong CA: exit %d, stderr %q; want exit 1 and %q", cmd, code, stderr, want)
		}
		if took := time.Since(start); took > 5*time.Second {
			t.Errorf("kfn %s with the wrong CA took %s to fail, want well under the connect timeout", cmd, took)
		}
		if strings.Contains(out+stderr, password) {
			t.Errorf("kfn %s prints the password: %s", cmd, out+stderr)
		}
		t.Logf("kfn %s with the wrong CA: %s", cmd, strings.TrimSpace(stderr))
	}
	var stderrW bytes.Buffer
	code = worker.Main(fn, []string{"--database-url", untrusted, "--kafka-brokers", strings.Join(k.Brokers, ","), "--nats-url", natsURL}, &stderrW)
	if code != 1 || !strings.Contains(stderrW.String(), want) || strings.Contains(stderrW.String(), password) {
		t.Errorf("a worker with the wrong CA: exit %d, stderr %q; want exit 1 and %q, without the password", code, stderrW.String(), want)
	}
}

// readmeGrants returns the fenced sql block of the "## Three roles" section
// of docs/production/postgres.md that creates the three roles.
func readmeGrants(t *testing.T) string {
	t.Helper()
	const page = "../../docs/production/postgres.md"
	data, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(data)
	start := strings.Index(doc, "\n## Three roles\n")
	if start < 0 {
		t.Fatalf(`%s has no "## Three roles" section`, page)
	}
	section := doc[start+1:]
	if end := regexp.MustCompile(`\n##+ `).FindStringIndex(section[1:]); end != nil {
		section = section[:end[0]+1]
	}
	for _, m := range regexp.MustCompile("(?s)```sql\n(.*?)```").FindAllStringSubmatch(section, -1) {
		if strings.Contains(m[1], "CREATE ROLE kfn_worker") {
			return m[1]
		}
	}
	t.Fatalf(`%s's "## Three roles" section has no sql block creating the role kfn_worker`, page)
	return ""
}

// TestReadmeRolesRunKfnWithLeastPrivilege runs the documented GRANTs
// (docs/production/postgres.md, "Three roles") as they are on a fresh
// cluster, migrates as kfn_migrator (kfn migrate and the
// function binary's migrate mode, which runs its Setup), runs a worker as
// kfn_worker with --skip-setup and checks what it wrote (business rows,
// inbox rows, outbox events relayed), then runs kfn status, replay and dlq
// list as kfn_operator. kfn_worker's rights are checked too: without
// --skip-setup it is refused with a message that says what to do, and it
// cannot create a table.
func TestReadmeRolesRunKfnWithLeastPrivilege(t *testing.T) {
	pg := startTLSPostgres(t)
	k := kfntest.Kafka(t)
	natsURL := kfntest.NATSURL(t)
	bucket := kfntest.Name(t, "leases")
	topic := k.CreateTopic(t, 1)
	fn := orders.Function()
	fn.Name, fn.Topic = kfntest.Name(t, "orders"), topic
	ctx := context.Background()

	if _, err := pg.admin.Exec(ctx, readmeGrants(t)); err != nil {
		t.Fatalf("the documented GRANTs: %v", err)
	}
	migrator := pg.url("kfn_migrator", "m-secret", "localhost", pg.caFile)
	workerURL := pg.url("kfn_worker", "w-secret", "localhost", pg.caFile)
	op := pg.url("kfn_operator", "o-secret", "localhost", pg.caFile)

	if code, out, stderr := kfn(t, "migrate", "--database-url", migrator); code != 0 {
		t.Fatalf("kfn migrate as kfn_migrator: exit %d, out %q, err %q", code, out, stderr)
	}
	for range 2 { // a Job that runs again finds everything in place
		var stderr bytes.Buffer
		if code := worker.Main(fn, []string{"migrate", "--database-url", migrator}, &stderr); code != 0 {
			t.Fatalf("%s migrate as kfn_migrator: exit %d, %s", fn.Name, code, stderr.String())
		}
	}
	var owner string
	if err := pg.admin.QueryRow(ctx, `SELECT tableowner FROM pg_tables WHERE schemaname = 'public' AND tablename = 'orders'`).Scan(&owner); err != nil || owner != "kfn_migrator" {
		t.Fatalf("table orders: owner %q (%v), want kfn_migrator (the function's Setup ran as the migrator)", owner, err)
	}

	cfg := runtime.Config{
		KafkaBrokers: k.Brokers, DatabaseURL: workerURL, NATSURL: natsURL, WorkerID: "least-privilege-worker",
		LeaseBucket: bucket, LeaseTTL: 2 * time.Second, LeaseRenew: 500 * time.Millisecond,
	}
	// Without --skip-setup, the DML-only role may not run the Setup DDL.
	if _, err := worker.New(ctx, cfg, fn); err == nil || !strings.Contains(err.Error(), "permission denied") ||
		!strings.Contains(err.Error(), "start the workers with --skip-setup (KFN_SKIP_SETUP)") || strings.Contains(err.Error(), "w-secret") {
		t.Fatalf("a worker as kfn_worker without --skip-setup: %v; want a refusal that says to run the migrate mode and --skip-setup", err)
	} else {
		t.Logf("kfn_worker without --skip-setup: %v", err)
	}
	var stderrW bytes.Buffer
	if code := worker.Main(fn, []string{"--database-url", workerURL, "--kafka-brokers", strings.Join(k.Brokers, ","), "--nats-url", natsURL,
		"--lease-bucket", bucket, "--lease-ttl", "2s", "--lease-renew", "500ms"}, &stderrW); code != 1 ||
		!strings.Contains(stderrW.String(), "--skip-setup (KFN_SKIP_SETUP)") {
		t.Errorf("the function binary as kfn_worker without --skip-setup: exit %d, %s", code, stderrW.String())
	}

	// A role with less than the documented grants is refused at start,
	// naming what it lacks, before anything runs.
	if _, err := pg.admin.Exec(ctx, `CREATE ROLE kfn_reader LOGIN; GRANT USAGE ON SCHEMA kfn TO kfn_reader; GRANT SELECT ON ALL TABLES IN SCHEMA kfn TO kfn_reader`); err != nil {
		t.Fatal(err)
	}
	reader := cfg
	reader.DatabaseURL, reader.SkipSetup = pg.url("kfn_reader", "r-secret", "localhost", pg.caFile), true
	const lacks = `invalid configuration: --database-url (DATABASE_URL): the role "kfn_reader" lacks privileges a worker needs in kfn's schema (INSERT on kfn.cursors, UPDATE on kfn.cursors, INSERT on kfn.lanes, INSERT on kfn.dead_letters, USAGE on kfn.dead_letters_id_seq,`
	if _, err := worker.New(ctx, reader, fn); err == nil || !strings.Contains(err.Error(), lacks) || !strings.Contains(err.Error(), "DELETE on kfn.outbox") {
		t.Errorf("a worker as a role that may only read kfn's tables: %v; want %q … DELETE on kfn.outbox", err, lacks)
	} else {
		t.Logf("kfn_reader: %v", err)
	}

	const n = 20
	produceTestOrders(t, k, topic, n)
	cfg.SkipSetup = true
	w, err := worker.New(ctx, cfg, fn)
	if err != nil {
		t.Fatalf("a worker as kfn_worker with --skip-setup: %v", err)
	}
	kfntest.Background(t, "worker", w.Run)
	waitFor(t, "the worker to apply every record", func() bool {
		var next int64
		return pg.admin.QueryRow(ctx, `SELECT next_offset FROM kfn.cursors WHERE consumer = $1`, fn.Name).Scan(&next) == nil && next == n+1
	})
	var rows, inbox, dead int
	if err := pg.admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = $1), (SELECT count(*) FROM kfn.dead_letters WHERE consumer = $1)`, fn.Name).Scan(&rows, &inbox, &dead); err != nil {
		t.Fatal(err)
	}
	if rows != n || inbox != n+1 || dead != 1 {
		t.Errorf("as kfn_worker: %d orders, %d inbox rows, %d dead letters; want %d, %d and 1", rows, inbox, dead, n, n+1)
	}
	waitFor(t, "the worker's relay to publish every event", func() bool {
		r, ok := w.RelayStats()
		return ok && r.Published == n
	})
	waitFor(t, "the relay (as kfn_worker) to delete the relayed outbox rows", func() bool {
		var left int
		return pg.admin.QueryRow(ctx, `SELECT count(*) FROM kfn.outbox`).Scan(&left) == nil && left == 0
	})
	if all, tls := pg.sessionsOverTLS(t, "kfn-worker least-privilege-worker"); all == 0 || tls != all {
		t.Errorf("the worker has %d sessions, %d of them over TLS; want all", all, tls)
	}

	// The operator's commands.
	brokers := strings.Join(k.Brokers, ",")
	code, out, errOut := kfn(t, "status", "--database-url", op, "--kafka-brokers", brokers, "--nats-url", natsURL, "--lease-bucket", bucket, "--function", fn.Name, "--json")
	var parts []operator.PartitionStatus
	if code != 0 || json.Unmarshal([]byte(out), &parts) != nil || len(parts) != 1 || parts[0].Cursor != n+1 || parts[0].Lag != 0 {
		t.Errorf("kfn status as kfn_operator: exit %d, out %q, err %q; want one partition at cursor %d, lag 0", code, out, errOut, n+1)
	}
	code, out, errOut = kfn(t, "dlq", "list", "--database-url", op, "--function", fn.Name)
	if code != 0 || !strings.Contains(out, "decode orders.Order JSON") {
		t.Errorf("kfn dlq list as kfn_operator: exit %d, out %q, err %q; want the dead letter", code, out, errOut)
	}
	code, out, errOut = kfn(t, "replay", "--database-url", op, "--nats-url", natsURL, "--lease-bucket", bucket, "--kafka-brokers", brokers,
		"--function", fn.Name, "--topic", topic, "--partition", "0", "--from-offset", "5")
	if code != 0 || !strings.Contains(out, fmt.Sprintf("cursor %d -> 5 (idempotent", n+1)) {
		t.Errorf("kfn replay as kfn_operator: exit %d, out %q, err %q", code, out, errOut)
	}
	waitFor(t, "the worker to skip the replayed records", func() bool {
		var next int64
		return pg.admin.QueryRow(ctx, `SELECT next_offset FROM kfn.cursors WHERE consumer = $1`, fn.Name).Scan(&next) == nil && next == n+1
	})
	if err := pg.admin.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&rows); err != nil || rows != n {
		t.Errorf("orders after the replay: %d (%v), want %d", rows, err, n)
	}
	code, out, errOut = kfn(t, "audit", "--database-url", op, "--function", fn.Name, "--action", "replay")
	if code != 0 || !strings.Contains(out, "replay") {
		t.Errorf("kfn audit as kfn_operator: exit %d, out %q, err %q", code, out, errOut)
	}

	// What the roles may not do.
	denied := func(who, dbURL, sql string) {
		t.Helper()
		p, err := pgxpool.New(ctx, dbURL)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		if _, err := p.Exec(ctx, sql); err == nil || !strings.Contains(err.Error(), "(SQLSTATE 42501)") {
			t.Errorf("%s: %s: %v; want insufficient_privilege (SQLSTATE 42501)", who, sql, err)
		}
	}
	denied("kfn_worker", workerURL, `CREATE TABLE public.not_allowed (id int)`)
	denied("kfn_worker", workerURL, `DROP TABLE orders`)
	denied("kfn_worker", workerURL, `ALTER TABLE kfn.inbox ADD COLUMN x int`)
	denied("kfn_operator", op, `SELECT count(*) FROM orders`)
	denied("kfn_operator", op, `CREATE TABLE kfn.not_allowed (id int)`)
}
