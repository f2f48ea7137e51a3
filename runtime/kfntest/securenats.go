package kfntest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"
)

// SecureNATS is an in-process nats-server as production runs it: TLS only
// (a certificate for 127.0.0.1 signed by a CA the test made), and
// decentralized JWT authentication (an operator, one account with
// JetStream, users issued by User), resolved from memory.
type SecureNATS struct {
	// URL is nats://127.0.0.1:PORT; the server requires TLS.
	URL string
	// CAFile is the PEM file of the CA that signs the server's certificate.
	CAFile string

	t       testing.TB
	dir     string
	account nkeys.KeyPair
}

// StartSecureNATS starts a SecureNATS that stops when the test ends.
func StartSecureNATS(t testing.TB) *SecureNATS {
	t.Helper()
	dir := t.TempDir()
	caFile, serverCert := testCertificates(t, dir, "ca.pem")

	operator := newKeys(t, nkeys.CreateOperator)
	opClaims := jwt.NewOperatorClaims(publicKey(t, operator))
	opClaims.Name = "kfntest"
	system := newKeys(t, nkeys.CreateAccount) // JetStream needs a system account
	opClaims.SystemAccount = publicKey(t, system)
	sysClaims := jwt.NewAccountClaims(publicKey(t, system))
	sysClaims.Name = "SYS"
	sysJWT, err := sysClaims.Encode(operator)
	if err != nil {
		t.Fatalf("kfntest: sign the system account JWT: %v", err)
	}
	account := newKeys(t, nkeys.CreateAccount)
	accClaims := jwt.NewAccountClaims(publicKey(t, account))
	accClaims.Name = "kfn"
	accClaims.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1, MaxAckPending: -1}
	accJWT, err := accClaims.Encode(operator)
	if err != nil {
		t.Fatalf("kfntest: sign the account JWT: %v", err)
	}
	if _, err := opClaims.Encode(operator); err != nil { // fills in the claims' issuer and id
		t.Fatalf("kfntest: sign the operator JWT: %v", err)
	}
	resolver := &server.MemAccResolver{}
	for pub, claims := range map[string]string{publicKey(t, account): accJWT, publicKey(t, system): sysJWT} {
		if err := resolver.Store(pub, claims); err != nil {
			t.Fatalf("kfntest: %v", err)
		}
	}
	s, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: filepath.Join(dir, "js"),
		NoLog: true, NoSigs: true, SystemAccount: publicKey(t, system),
		TrustedOperators: []*jwt.OperatorClaims{opClaims}, AccountResolver: resolver,
		TLS: true, TLSConfig: &tls.Config{Certificates: []tls.Certificate{serverCert}, MinVersion: tls.VersionTLS12}, TLSTimeout: 2,
	})
	if err != nil {
		t.Fatalf("kfntest: secure nats-server: %v", err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("kfntest: secure nats-server not ready")
	}
	t.Cleanup(s.Shutdown)
	return &SecureNATS{URL: s.ClientURL(), CAFile: caFile, t: t, dir: dir, account: account}
}

// User issues a user of the account and writes its .creds file (its JWT
// and NKey seed), returning the file and the two secrets in it, so that a
// test can check they are never printed. denyPublish lists subjects the
// user may not publish to, such as "$JS.API.STREAM.CREATE.>".
func (n *SecureNATS) User(name string, denyPublish ...string) (credsFile, userJWT, seed string) {
	t := n.t
	t.Helper()
	user := newKeys(t, nkeys.CreateUser)
	claims := jwt.NewUserClaims(publicKey(t, user))
	claims.Name = name
	for _, s := range denyPublish {
		claims.Pub.Deny.Add(s)
	}
	userJWT, err := claims.Encode(n.account)
	if err != nil {
		t.Fatalf("kfntest: sign the user JWT: %v", err)
	}
	seedBytes, err := user.Seed()
	if err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	creds, err := jwt.FormatUserConfig(userJWT, seedBytes)
	if err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	credsFile = filepath.Join(n.dir, name+".creds")
	if err := os.WriteFile(credsFile, creds, 0o600); err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	return credsFile, userJWT, string(seedBytes)
}

// OtherCA writes the PEM file of a CA that signed nothing the server holds:
// a client that trusts only it must refuse the server.
func (n *SecureNATS) OtherCA() string {
	n.t.Helper()
	caFile, _ := testCertificates(n.t, n.dir, "other-ca.pem")
	return caFile
}

func newKeys(t testing.TB, create func() (nkeys.KeyPair, error)) nkeys.KeyPair {
	t.Helper()
	kp, err := create()
	if err != nil {
		t.Fatalf("kfntest: create nkeys: %v", err)
	}
	return kp
}

func publicKey(t testing.TB, kp nkeys.KeyPair) string {
	t.Helper()
	pub, err := kp.PublicKey()
	if err != nil {
		t.Fatalf("kfntest: %v", err)
	}
	return pub
}

// testCertificates makes a CA, writes its certificate to dir/caName, and
// returns it with a server certificate for 127.0.0.1 and localhost that it
// signed.
func testCertificates(t testing.TB, dir, caName string) (string, tls.Certificate) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kfntest CA " + caName},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	caFile := filepath.Join(dir, caName)
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, DNSNames: []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	return caFile, tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}
