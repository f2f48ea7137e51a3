package connect

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/runtime"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"
)

// tokenServer starts a real NATS server, in this process, that wants token.
func tokenServer(t *testing.T, token string) string {
	t.Helper()
	return startServer(t, &server.Options{JetStream: true, StoreDir: t.TempDir(), Authorization: token})
}

// startServer starts a real NATS server, in this process, with opts on a
// free loopback port, and returns its URL.
func startServer(t *testing.T, opts *server.Options) string {
	t.Helper()
	opts.Host, opts.Port, opts.NoLog, opts.NoSigs = "127.0.0.1", -1, true, true
	s, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server not ready")
	}
	t.Cleanup(s.Shutdown)
	return s.ClientURL()
}

func TestNATSTokenFromAFileOrTheURL(t *testing.T) {
	const token = "tokFile8Zp2secret"
	natsURL := tokenServer(t, token)
	dir := t.TempDir()
	file := filepath.Join(dir, "token")
	if err := os.WriteFile(file, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	nc, _, err := NATSWith(natsURL, "test", runtime.NATSSecurity{TokenFile: file})
	if err != nil {
		t.Fatalf("token file: %v", err)
	}
	nc.Close()
	withToken := strings.Replace(natsURL, "nats://", "nats://"+token+"@", 1)
	nc, _, err = NATS(withToken, "test")
	if err != nil {
		t.Fatalf("token in the URL: %v", err)
	}
	nc.Close()

	for _, tc := range []struct {
		name, url string
		auth      runtime.NATSSecurity
		want      string
	}{
		{"no token", natsURL, runtime.NATSSecurity{}, "wants credentials: set --nats-creds (KFN_NATS_CREDS)"},
		{"wrong token in the URL", strings.Replace(natsURL, "nats://", "nats://wrongTok4Qsecret@", 1), runtime.NATSSecurity{}, "NATS at nats://xxxxx@127.0.0.1"},
		{"unreadable token file", natsURL, runtime.NATSSecurity{TokenFile: filepath.Join(dir, "missing")}, "--nats-token-file (KFN_NATS_TOKEN_FILE): cannot read the token file"},
		{"unreadable creds file", natsURL, runtime.NATSSecurity{Creds: filepath.Join(dir, "missing.creds")}, "--nats-creds (KFN_NATS_CREDS): cannot read the credentials file"},
		{"both", natsURL, runtime.NATSSecurity{Creds: file, TokenFile: file}, "--nats-token-file (KFN_NATS_TOKEN_FILE): is given with --nats-creds (KFN_NATS_CREDS): give only one of"},
	} {
		nc, _, err := NATSWith(tc.url, "test", tc.auth)
		if err == nil {
			nc.Close()
			t.Errorf("%s: connected", tc.name)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "wrongTok4Qsecret") || strings.Contains(err.Error(), token) {
			t.Errorf("%s: %v; want %q and no token", tc.name, err, tc.want)
		}
	}
}

// An NKey user connects with its seed file; a bad CA, a certificate
// without its key and a file that is no .creds are refused before any
// connection, naming the setting and never quoting the seed.
func TestNATSNKeySeedFileAndBadFiles(t *testing.T) {
	user, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	pub, _ := user.PublicKey()
	seed, _ := user.Seed()
	natsURL := startServer(t, &server.Options{Nkeys: []*server.NkeyUser{{Nkey: pub}}})
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	seedFile := write("user.nk", string(seed)+"\n")
	nc, _, err := NATSWith(natsURL, "test", runtime.NATSSecurity{NKeyFile: seedFile})
	if err != nil {
		t.Fatalf("nkey seed file: %v", err)
	}
	nc.Close()

	notPEM := write("ca.pem", "not a certificate")
	for _, tc := range []struct {
		name string
		sec  runtime.NATSSecurity
		want string
	}{
		{"no nkey", runtime.NATSSecurity{}, "wants credentials: set --nats-creds (KFN_NATS_CREDS)"},
		{"seed file holds no seed", runtime.NATSSecurity{NKeyFile: notPEM}, "--nats-nkey (KFN_NATS_NKEY): cannot use"},
		{"CA file holds no PEM", runtime.NATSSecurity{NKeyFile: seedFile, CAFile: notPEM}, "--nats-ca (KFN_NATS_CA): " + notPEM + " holds no PEM certificate"},
		{"unreadable CA", runtime.NATSSecurity{CAFile: filepath.Join(dir, "missing.pem")}, "--nats-ca (KFN_NATS_CA): cannot read the CA file"},
		{"cert without key", runtime.NATSSecurity{CertFile: notPEM}, "--nats-key (KFN_NATS_KEY): --nats-cert " + notPEM + " is given without its private key"},
		{"not a creds file", runtime.NATSSecurity{Creds: seedFile}, "--nats-creds (KFN_NATS_CREDS): " + seedFile + " is not a NATS credentials file"},
		{"creds and nkey", runtime.NATSSecurity{Creds: seedFile, NKeyFile: seedFile}, "--nats-nkey (KFN_NATS_NKEY): is given with --nats-creds (KFN_NATS_CREDS): give only one of"},
		{"TLS to a server without TLS", runtime.NATSSecurity{NKeyFile: seedFile, CAFile: write("ok.pem", testCA(t))}, "does not offer TLS: drop --nats-ca"},
	} {
		nc, _, err := NATSWith(natsURL, "test", tc.sec)
		if err == nil {
			nc.Close()
			t.Errorf("%s: connected", tc.name)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), string(seed)) {
			t.Errorf("%s: %v; want %q and no seed", tc.name, err, tc.want)
		}
	}
}

// testCA is the PEM of a self-signed CA certificate.
func testCA(t *testing.T) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
}
