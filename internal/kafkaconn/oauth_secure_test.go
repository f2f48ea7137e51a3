//go:build kafkasecure

package kafkaconn_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// testOAuthBearer runs kfn over the broker's OAUTHBEARER logins, with
// tokens from tokens.
func testOAuthBearer(t *testing.T, k *secureKafka, tokens *tokenServer, kfnBin string, pg *kfntest.PG, natsURL string) {
	oauth := func(client, secret string) runtime.KafkaSecurity {
		return runtime.KafkaSecurity{CAFile: k.sec.CAFile, SASLMechanism: "OAUTHBEARER",
			OAuthTokenURL: tokens.TokenURL(), OAuthClientID: client, OAuthClientSecret: secret}
	}

	t.Run("a worker applies every record once while its tokens expire and are refreshed", func(t *testing.T) {
		const lifetime = 8 * time.Second
		client := kfntest.Name(t, "worker")
		tokens.addClient(client, "s3cret-"+client, lifetime)
		fn, topic := kfntest.Name(t, "oauth"), kfntest.Name(t, "oauth")
		if _, err := kfnCLI(t, kfnBin, k, "", "topic", "create", topic, "--partitions", "2"); err != nil {
			t.Fatal(err)
		}

		// The effects function, timing each record's apply.
		f := effects.Function(fn, topic)
		var mu sync.Mutex
		appliedAt := map[[2]int64]time.Time{}
		handle := f.Handler
		f.Handler = func(ctx context.Context, tx pgx.Tx, rec runtime.Record, out *runtime.Events) error {
			err := handle(ctx, tx, rec, out)
			if err == nil {
				mu.Lock()
				appliedAt[[2]int64{int64(rec.Partition), rec.Offset}] = time.Now()
				mu.Unlock()
			}
			return err
		}
		logs := &countingHandler{t: t, counts: map[string]int{}}
		cfg := runtime.Config{
			KafkaBrokers: k.brokers, KafkaSecurity: runtime.KafkaSecurity(oauth(client, "s3cret-"+client)),
			DatabaseURL: pg.URL, NATSURL: natsURL, LeaseTTL: 3 * time.Second, LeaseRenew: time.Second,
			Logger: slog.New(logs),
		}
		w, err := worker.New(context.Background(), cfg, f)
		if err != nil {
			t.Fatalf("start a worker over OAUTHBEARER: %v", err)
		}
		stop := kfntest.Background(t, "worker", w.Run)

		// A record every 50 ms, for three token lifetimes and more; the
		// producer logs in with SCRAM, so that only the worker's tokens
		// expire.
		producer, closeProducer, err := kafkaconn.Client(k.brokers, k.sec)
		if err != nil {
			t.Fatal(err)
		}
		defer closeProducer()
		var produced []effects.Produced
		producedAt := map[[2]int64]time.Time{}
		start := time.Now()
		for i := 0; time.Since(start) < 3*lifetime+4*time.Second; i++ {
			part := i % 2
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			res, err := producer.Produce(ctx, &kafka.ProduceRequest{
				Topic: topic, Partition: part, RequiredAcks: kafka.RequireAll,
				Records: kafka.NewRecordReader(kafka.Record{Key: kafka.NewBytes([]byte("k" + strconv.Itoa(i))), Value: kafka.NewBytes([]byte("v" + strconv.Itoa(i)))}),
			})
			cancel()
			if err == nil {
				err = res.Error
			}
			if err != nil {
				t.Fatalf("produce record %d: %v", i, err)
			}
			produced = append(produced, effects.Produced{Partition: int32(part), Offset: res.BaseOffset})
			producedAt[[2]int64{int64(part), res.BaseOffset}] = time.Now()
			time.Sleep(50 * time.Millisecond)
		}
		n := len(produced)
		deadline := time.Now().Add(60 * time.Second)
		for {
			mu.Lock()
			applied := len(appliedAt)
			mu.Unlock()
			if applied >= n {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the worker applied %d of %d records within 60s of the last", applied, n)
			}
			time.Sleep(100 * time.Millisecond)
		}
		stop()
		report, err := effects.Check(context.Background(), pg.Pool, fn, topic, produced)
		if err != nil {
			t.Fatal(err)
		}
		if !report.OK() {
			t.Fatalf("not exactly once: %s", report)
		}

		// How long a record waited from its produce to its apply, at most:
		// the stall a token's expiry caused, if any.
		var worst time.Duration
		var worstAt [2]int64
		for key, at := range producedAt {
			if d := appliedAt[key].Sub(at); d > worst {
				worst, worstAt = d, key
			}
		}
		issued := tokens.issuedTo(client)
		for i := 1; i < len(issued); i++ {
			if !issued[i].at.Before(issued[i-1].expiry) {
				t.Errorf("token %d was issued at %s, not before token %d expired (%s): not refreshed ahead of its expiry",
					i+1, issued[i].at.Format(time.TimeOnly), i, issued[i-1].expiry.Format(time.TimeOnly))
			}
		}
		readFailures := logs.count("cannot read from Kafka: waiting, keeping the partition")
		notReady := logs.count("not ready")
		t.Logf("OAUTHBEARER refresh: token lifetime %s, %d tokens issued (%d refreshes) over %s, %d records applied once each, "+
			"%d reads failed (a connection the broker closed at its token's expiry), %d readiness probes failed, the longest a record waited from produce to apply: %.2fs (partition %d offset %d)",
			lifetime, len(issued), len(issued)-1, time.Since(start).Round(time.Second), n, readFailures, notReady, worst.Seconds(), worstAt[0], worstAt[1])
		if len(issued) < 4 {
			t.Errorf("%d tokens were issued in %s with a lifetime of %s: want at least 4 (one, then a refresh at 80%% of each lifetime)", len(issued), 3*lifetime+4*time.Second, lifetime)
		}
		if readFailures > 0 || notReady > 0 {
			t.Errorf("%d reads and %d readiness probes failed: a connection was still logged in with an expired token (the broker closes it at its next request)", readFailures, notReady)
		}
		if worst > cfg.LeaseTTL {
			t.Errorf("a record waited %s from its produce to its apply, longer than the lease TTL %s: a token refresh stalled the worker", worst, cfg.LeaseTTL)
		}
	})

	t.Run("a wrong client secret fails the worker at start naming the flag", func(t *testing.T) {
		client := kfntest.Name(t, "wrong")
		tokens.addClient(client, "the-right-secret", time.Hour)
		secretFile := filepath.Join(t.TempDir(), "client-secret")
		if err := os.WriteFile(secretFile, []byte("a-wrong-secret\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		fn := kfntest.Name(t, "oauth")
		var stderr bytes.Buffer
		start := time.Now()
		code := worker.Main(effects.Function(fn, "orders"), []string{
			"--kafka-brokers", strings.Join(k.brokers, ","), "--database-url", pg.URL, "--nats-url", natsURL,
			"--kafka-ca", k.sec.CAFile, "--kafka-sasl-mechanism", "OAUTHBEARER",
			"--kafka-oauth-token-url", tokens.TokenURL(), "--kafka-oauth-client-id", client,
			"--kafka-oauth-client-secret-file", secretFile,
		}, &stderr)
		took := time.Since(start)
		first := firstLine(stderr.String())
		t.Logf("exit %d in %s: %s", code, took.Round(time.Millisecond), first)
		if code != 1 {
			t.Errorf("exit code %d, want 1 (a service refused the credentials)", code)
		}
		prefix := fn + ": cannot connect to Kafka: "
		want := fmt.Sprintf("cannot get a Kafka OAUTHBEARER token from --kafka-oauth-token-url (KFN_KAFKA_OAUTH_TOKEN_URL) %s: the token endpoint refused --kafka-oauth-client-id (KFN_KAFKA_OAUTH_CLIENT_ID) %q with its secret (KFN_KAFKA_OAUTH_CLIENT_SECRET or --kafka-oauth-client-secret-file)",
			tokens.TokenURL(), client)
		if !strings.HasPrefix(first, prefix) || !strings.Contains(first, want) {
			t.Errorf("first line of stderr:\n%s\nwant it to start with %q and hold:\n%s", first, prefix, want)
		}
		if strings.Contains(stderr.String(), "a-wrong-secret") {
			t.Errorf("stderr shows the client secret:\n%s", stderr.String())
		}
		if took > 15*time.Second {
			t.Errorf("the worker took %s to fail, want well under 15s", took)
		}
	})

	t.Run("the kfn CLI logs in with the client secret in a file", func(t *testing.T) {
		client := kfntest.Name(t, "cli")
		tokens.addClient(client, "cli-secret", time.Hour)
		secretFile := filepath.Join(t.TempDir(), "client-secret")
		if err := os.WriteFile(secretFile, []byte("cli-secret\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		cli := *k
		cli.sec = oauth(client, "")
		cli.sec.OAuthClientSecretFile = secretFile
		topic := kfntest.Name(t, "oauth")
		if _, err := kfnCLI(t, kfnBin, &cli, "", "topic", "create", topic, "--partitions", "1"); err != nil {
			t.Fatal(err)
		}
		out, err := kfnCLI(t, kfnBin, &cli, "", "topic", "list")
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out, topic) {
			t.Errorf("kfn topic list over OAUTHBEARER does not list %s:\n%s", topic, out)
		}
		if got := len(tokens.issuedTo(client)); got != 2 {
			t.Errorf("%d tokens issued to the CLI's client for its two runs, want 2", got)
		}
	})

	t.Run("a token file is read again when it changes", func(t *testing.T) {
		file := filepath.Join(t.TempDir(), "token")
		write := func(tok string, n int) {
			t.Helper()
			if err := os.WriteFile(file, []byte(tok+"\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			// A distinct modification time for each version of the file.
			at := time.Now().Add(time.Duration(n) * time.Second)
			if err := os.Chtimes(file, at, at); err != nil {
				t.Fatal(err)
			}
		}
		claims := func() map[string]any {
			return map[string]any{"iss": tokens.URL, "sub": "file-user", "aud": tokenAudience, "iat": time.Now().Unix(), "exp": time.Now().Add(time.Hour).Unix()}
		}
		write(tokens.sign(claims()), 1)
		sec := runtime.KafkaSecurity{CAFile: k.sec.CAFile, SASLMechanism: "OAUTHBEARER", OAuthTokenFile: file}
		client, closeIdle, err := kafkaconn.Client(k.brokers, sec)
		if err != nil {
			t.Fatal(err)
		}
		defer closeIdle()
		metadata := func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			closeIdle() // a new connection, a new login
			_, err := client.Metadata(ctx, &kafka.MetadataRequest{})
			return kafkaconn.Explain(err, k.brokers, sec)
		}
		if err := metadata(); err != nil {
			t.Fatalf("with the token of the file: %v", err)
		}
		// A token signed by a key the broker does not know.
		other, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			t.Fatal(err)
		}
		write(signJWT(other, tokens.kid, claims()), 2)
		err = metadata()
		if err == nil {
			t.Fatal("the broker took a token it cannot verify: the file was not read again, or the broker checks nothing")
		}
		if !strings.Contains(err.Error(), "refused the OAUTHBEARER token from --kafka-oauth-token-file (KFN_KAFKA_OAUTH_TOKEN_FILE) "+file) {
			t.Errorf("the refusal does not name the token file setting: %v", err)
		}
		t.Logf("a token the broker cannot verify: %v", err)
		write(tokens.sign(claims()), 3)
		if err := metadata(); err != nil {
			t.Fatalf("with the file's good token again: %v", err)
		}
	})
}

// countingHandler counts a worker's log records by message, and writes
// its warnings and errors to the test's log.
type countingHandler struct {
	t      *testing.T
	mu     sync.Mutex
	counts map[string]int
	attrs  []slog.Attr
}

func (h *countingHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h *countingHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	h.counts[r.Message]++
	h.mu.Unlock()
	if r.Level >= slog.LevelWarn {
		var b strings.Builder
		r.Attrs(func(a slog.Attr) bool {
			fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
			return true
		})
		h.t.Logf("worker %s: %s%s", r.Level, r.Message, b.String())
	}
	return nil
}

func (h *countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countingHandler) WithGroup(string) slog.Handler      { return h }

func (h *countingHandler) count(msg string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.counts[msg]
}
