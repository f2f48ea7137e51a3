package connect

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// tokenServer starts a real NATS server, in this process, that wants token.
func tokenServer(t *testing.T, token string) string {
	t.Helper()
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), Authorization: token, NoLog: true, NoSigs: true})
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
	nc, _, err := NATSWith(natsURL, "test", NATSSecurity{TokenFile: file})
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
		auth      NATSSecurity
		want      string
	}{
		{"no token", natsURL, NATSSecurity{}, "wants credentials: set --nats-creds (KFN_NATS_CREDS)"},
		{"wrong token in the URL", strings.Replace(natsURL, "nats://", "nats://wrongTok4Qsecret@", 1), NATSSecurity{}, "NATS at nats://xxxxx@127.0.0.1"},
		{"unreadable token file", natsURL, NATSSecurity{TokenFile: filepath.Join(dir, "missing")}, "--nats-token-file (KFN_NATS_TOKEN_FILE): cannot read the token file"},
		{"unreadable creds file", natsURL, NATSSecurity{Creds: filepath.Join(dir, "missing.creds")}, "--nats-creds (KFN_NATS_CREDS): cannot read the credentials file"},
		{"both", natsURL, NATSSecurity{Creds: file, TokenFile: file}, "give one of --nats-creds (KFN_NATS_CREDS), --nats-token-file (KFN_NATS_TOKEN_FILE), not"},
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
