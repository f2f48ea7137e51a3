//go:build kafkasecure

// The tests of this file run kfn against a real Apache Kafka broker whose
// only listener is SASL_SSL (TLS, with SCRAM-SHA-512 and OAUTHBEARER
// logins), which they start with deploy/local/kafka/kafka.sh
// (KFN_KAFKA_SECURE=1 and KFN_KAFKA_OAUTH_JWKS_URL pointing at the test's
// own token server; Java and Maven needed).
// They are behind the kafkasecure build tag, so that the default test run
// does not start a JVM: `go tool task test:kafka-secure` and .ci/run run
// them.
package kafkaconn_test

import (
	"bufio"
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
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

func TestMain(m *testing.M) { kfntest.Main(m) }

// secureKafka is a broker with a SASL_SSL listener only, whose OAUTHBEARER
// logins are checked against the keys of a tokenServer.
type secureKafka struct {
	brokers []string
	sec     runtime.KafkaSecurity // the CA, user kfn and its password file
	tlsDir  string
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startSecureKafka starts the broker on free ports in a data dir of the
// test's, taking OAUTHBEARER tokens issued by tokens, and
// stops it when the test ends.
func startSecureKafka(t *testing.T, tokens *tokenServer) *secureKafka {
	t.Helper()
	script, err := filepath.Abs("../../deploy/local/kafka/kafka.sh")
	if err != nil {
		t.Fatal(err)
	}
	data := t.TempDir()
	port, cport := freePort(t), freePort(t)
	env := append(os.Environ(), "KFN_KAFKA_SECURE=1", "KFN_KAFKA_DATA="+data,
		"KFN_KAFKA_PORT="+strconv.Itoa(port), "KFN_KAFKA_CONTROLLER_PORT="+strconv.Itoa(cport),
		"KFN_KAFKA_OAUTH_JWKS_URL="+tokens.JWKSURL(), "KFN_KAFKA_OAUTH_ISSUER="+tokens.URL, "KFN_KAFKA_OAUTH_AUDIENCE="+tokenAudience)
	run := func(arg string) ([]byte, error) {
		cmd := exec.Command("bash", script, arg)
		cmd.Env = env
		return cmd.CombinedOutput()
	}
	t.Cleanup(func() {
		if out, err := run("down"); err != nil {
			t.Errorf("kafka.sh down: %v\n%s", err, out)
		}
	})
	start := time.Now()
	if out, err := run("up"); err != nil {
		t.Fatalf("kafka.sh up (KFN_KAFKA_SECURE=1): %v\n%s", err, out)
	}
	t.Logf("secure Kafka (SASL_SSL, SCRAM-SHA-512 and OAUTHBEARER) up on 127.0.0.1:%d in %s", port, time.Since(start).Round(time.Millisecond))
	tlsDir := filepath.Join(data, "tls")
	return &secureKafka{
		brokers: []string{fmt.Sprintf("127.0.0.1:%d", port)},
		tlsDir:  tlsDir,
		sec: runtime.KafkaSecurity{
			CAFile:        filepath.Join(tlsDir, "ca.pem"),
			SASLMechanism: "SCRAM-SHA-512", SASLUser: "kfn",
			SASLPasswordFile: filepath.Join(tlsDir, "kfn.password"),
		},
	}
}

// kfnCLI runs the kfn command with the broker's security settings in its
// environment (the password as a file) and returns its stdout.
func kfnCLI(t *testing.T, bin string, k *secureKafka, stdin string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "KFN_KAFKA_BROKERS="+strings.Join(k.brokers, ","))
	cmd.Env = append(cmd.Env, kafkaconn.Env(k.sec)...)
	cmd.Stdin = strings.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return stdout.String(), fmt.Errorf("kfn %s: %v: %s", strings.Join(args, " "), err, stderr.String())
		}
		return stdout.String(), nil
	case <-ctx.Done():
		cmd.Process.Kill()
		<-done
		t.Fatalf("kfn %s did not finish within 60s", strings.Join(args, " "))
		return "", nil
	}
}

// otherCA writes a CA certificate that did not sign the broker's.
func otherCA(t *testing.T) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "some other CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "other-ca.pem")
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestWorkerOverSASLSSL(t *testing.T) {
	tokens := newTokenServer(t)
	k := startSecureKafka(t, tokens)
	kfn := kfntest.BuildBinary(t, "github.com/kfn-dev/kfn/cmd/kfn")
	pg := kfntest.Postgres(t)
	natsURL := kfntest.NATSURL(t)
	config := func(sec runtime.KafkaSecurity) runtime.Config {
		return runtime.Config{
			KafkaBrokers: k.brokers, KafkaSecurity: runtime.KafkaSecurity(sec), DatabaseURL: pg.URL, NATSURL: natsURL,
			LeaseTTL: 3 * time.Second, LeaseRenew: time.Second,
		}
	}

	t.Run("records produced by kfn produce are applied once by a worker", func(t *testing.T) {
		fn, topic := kfntest.Name(t, "sec"), kfntest.Name(t, "sec")
		if _, err := kfnCLI(t, kfn, k, "", "topic", "create", topic, "--partitions", "2"); err != nil {
			t.Fatal(err)
		}
		const n = 20
		var lines strings.Builder
		for i := range n {
			fmt.Fprintf(&lines, `{"key":"k%d","value":"v%d","partition":%d}`+"\n", i, i, i%2)
		}
		out, err := kfnCLI(t, kfn, k, lines.String(), "produce", topic, "--file", "-", "--json")
		if err != nil {
			t.Fatal(err)
		}
		var produced []effects.Produced
		sc := bufio.NewScanner(strings.NewReader(out))
		for sc.Scan() {
			var p struct {
				Partition int32 `json:"partition"`
				Offset    int64 `json:"offset"`
			}
			if err := json.Unmarshal(sc.Bytes(), &p); err != nil {
				t.Fatalf("kfn produce printed %q: %v", sc.Text(), err)
			}
			produced = append(produced, effects.Produced{Partition: p.Partition, Offset: p.Offset})
		}
		if len(produced) != n {
			t.Fatalf("kfn produce reported %d records, want %d:\n%s", len(produced), n, out)
		}

		w, err := worker.New(context.Background(), config(k.sec), effects.Function(fn, topic))
		if err != nil {
			t.Fatalf("start worker over SASL_SSL: %v", err)
		}
		stop := kfntest.Background(t, "worker", w.Run)
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		for {
			var applied int
			if err := pg.Pool.QueryRow(ctx, `SELECT count(*) FROM `+effects.Table(fn)).Scan(&applied); err != nil && ctx.Err() == nil {
				// The table appears with the worker's setup.
			} else if applied >= n {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("the worker did not apply %d records within 60s", n)
			}
			time.Sleep(200 * time.Millisecond)
		}
		stop()
		report, err := effects.Check(context.Background(), pg.Pool, fn, topic, produced)
		if err != nil {
			t.Fatal(err)
		}
		if !report.OK() {
			t.Fatalf("not exactly once: %s", report)
		}

		// The operator's tools read Kafka with the same settings.
		desc, err := kfnCLI(t, kfn, k, "", "topic", "describe", topic)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(desc, "10") {
			t.Errorf("kfn topic describe does not show the high watermarks (10 per partition):\n%s", desc)
		}
	})

	fastFailure := func(t *testing.T, sec runtime.KafkaSecurity, cause connect.Cause, want ...string) {
		t.Helper()
		start := time.Now()
		_, err := worker.New(context.Background(), config(sec), effects.Function(kfntest.Name(t, "sec"), "orders"))
		took := time.Since(start)
		if err == nil {
			t.Fatal("the worker started")
		}
		if took > 15*time.Second {
			t.Errorf("the worker took %s to fail, want well under 15s (the connect timeout is 10s)", took)
		}
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("the error does not name %q:\n%v", w, err)
			}
		}
		if got := kafkaconn.Cause(err); got != cause {
			t.Errorf("kafkaconn.Cause = %v, want %v: %v", got, cause, err)
		}
		t.Logf("failed in %s: %v", took.Round(time.Millisecond), err)
	}

	t.Run("a wrong password fails fast naming the settings", func(t *testing.T) {
		sec := k.sec
		sec.SASLPasswordFile, sec.SASLPassword = "", "not-the-password"
		fastFailure(t, sec, connect.CauseAuth, "refused the SASL credentials", "--kafka-sasl-user", "KFN_KAFKA_SASL_PASSWORD")
		// The CLI says the same.
		bad := filepath.Join(t.TempDir(), "pw")
		os.WriteFile(bad, []byte("not-the-password\n"), 0o600)
		cli := *k
		cli.sec.SASLPasswordFile = bad
		if _, err := kfnCLI(t, kfn, &cli, "", "topic", "list"); err == nil || !strings.Contains(err.Error(), "refused the SASL credentials of --kafka-sasl-user") {
			t.Errorf("kfn topic list with a wrong password: %v", err)
		}
	})

	t.Run("an untrusted CA fails fast naming --kafka-ca", func(t *testing.T) {
		sec := k.sec
		sec.CAFile = otherCA(t)
		fastFailure(t, sec, connect.CauseTLS, "unknown authority", "--kafka-ca")
		cli := *k
		cli.sec.CAFile = sec.CAFile
		if _, err := kfnCLI(t, kfn, &cli, "", "topic", "list"); err == nil || !strings.Contains(err.Error(), "check --kafka-ca") {
			t.Errorf("kfn topic list with another CA: %v", err)
		}
	})

	t.Run("OAUTHBEARER", func(t *testing.T) { testOAuthBearer(t, k, tokens, kfn, pg, natsURL) })

	t.Run("a client without TLS is told to set it", func(t *testing.T) {
		_, err := worker.New(context.Background(), config(runtime.KafkaSecurity{}), effects.Function(kfntest.Name(t, "sec"), "orders"))
		if err == nil || !strings.Contains(err.Error(), "--kafka-tls") {
			t.Errorf("a plain worker against the SASL_SSL listener: %v", err)
		}
	})
}
