package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kfn-dev/kfn/cmd/kfn/internal/console"
	"github.com/kfn-dev/kfn/internal/settings"
)

func runConsole(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("console", help{
		usage: []string{"kfn console (--auth-file FILE | --trust-proxy-header HEADER) [--allow-writes] [--listen ADDR] [flags]"},
		text: `
Serves a web console for the people on call: every lane's owner, cursor,
lag and commit rate, live; dead letters grouped by function, reason and
error fingerprint, each record's bytes shown inertly; parked keys; replay
with its dry-run plan first; the audit log; verify. Retries, discards and
replays go through the same operator functions as kfn dlq and kfn replay,
audited with the console user as the actor (console:<user>).

It never runs open: give --auth-file (users log in with a secret; each line
is name:role:sha256:HEX, role viewer or writer, HEX the SHA-256 of the
secret) or --trust-proxy-header when an auth proxy in front of it sets the
user's name. It is read-only unless started with --allow-writes, and a write
also needs the writer role. Five failed logins of a name (twenty from an
address) lock it out, for longer each time. See docs/console.md for the
security model.

With --function-databases it reads and acts on each function's own
database, and shows every database's functions together.`,
		examples: `
kfn console --auth-file /etc/kfn/console-users --listen 127.0.0.1:8080
kfn console --auth-file users --allow-writes --tls-cert cert.pem --tls-key key.pem --listen :8443
kfn console --trust-proxy-header X-Forwarded-User --proxy-writers alice,bob --allow-writes
kfn console --auth-file users --database-url "$ORDERS_DB" --function-databases "ledger=$LEDGER_DB"`,
	}, stderr)
	databases := bindDatabases(fs)
	brokersSetting := settings.KafkaBrokers
	brokersSetting.Usage += "; with it the overview shows the lag, and replays are possible"
	brokers := bind(fs, brokersSetting)
	sec := bindKafkaSecurity(fs)
	nats := settings.NATSURL
	nats.Usage += "; with it the overview shows the lease holders, and replays are possible"
	natsURL := bind(fs, nats)
	natsSec := bindNATSSecurity(fs)
	bucket := bind(fs, settings.LeaseBucket)
	stream := bind(fs, settings.EventStream)
	listen := fs.String("listen", "127.0.0.1:8080", "the `address` to serve on")
	authFile := fs.String("auth-file", "", "the `file` of users: one name:role:sha256:HEX a line (see above)")
	proxyHeader := fs.String("trust-proxy-header", "", "take the user's name from this request `header`, set by an auth proxy in front of the console (never expose the console itself then)")
	proxyWriters := fs.String("proxy-writers", "", "with --trust-proxy-header: the comma-separated `users` with the writer role (the others are viewers)")
	clientAddressHeader := fs.String("client-address-header", "", "with --auth-file behind a reverse proxy: the request `header` the proxy sets to the client's address (its last comma-separated entry), which failed logins count against instead of the proxy's (default: the TCP peer's address; X-Forwarded-For is never read unless named here)")
	allowWrites := fs.Bool("allow-writes", false, "let writers retry, discard and replay (default: read-only)")
	tlsCert := fs.String("tls-cert", "", "serve TLS with this certificate `file` (PEM); needs --tls-key")
	tlsKey := fs.String("tls-key", "", "the private key `file` of --tls-cert (PEM)")
	if err := parse(fs, args); err != nil {
		return err
	}
	urls, err := databases.all()
	if err != nil {
		return err
	}
	cfg := console.Config{KafkaBrokers: *brokers, KafkaSecurity: *sec, LeaseBucket: *bucket, EventStream: *stream, AllowWrites: *allowWrites,
		ProxyHeader: strings.TrimSpace(*proxyHeader), ClientAddressHeader: strings.TrimSpace(*clientAddressHeader), TLS: *tlsCert != "",
		Log: slog.New(slog.NewTextHandler(stderr, nil))}
	switch {
	case *authFile == "" && cfg.ProxyHeader == "":
		return &usageError{msg: console.ErrNoAuth.Error()}
	case *authFile != "" && cfg.ProxyHeader != "":
		return &usageError{msg: "--auth-file and --trust-proxy-header exclude each other"}
	case *clientAddressHeader != "" && cfg.ProxyHeader != "":
		return &usageError{msg: "--client-address-header is for the login form of --auth-file; behind --trust-proxy-header the proxy logs users in and limits their failures"}
	case *proxyWriters != "" && cfg.ProxyHeader == "":
		return &usageError{msg: "--proxy-writers needs --trust-proxy-header (with --auth-file, the file gives the roles)"}
	case (*tlsCert == "") != (*tlsKey == ""):
		return &usageError{msg: "--tls-cert and --tls-key go together"}
	}
	for _, w := range strings.Split(*proxyWriters, ",") {
		if w = strings.TrimSpace(w); w != "" {
			cfg.ProxyWriters = append(cfg.ProxyWriters, w)
		}
	}
	if *authFile != "" {
		f, err := os.Open(*authFile)
		if err != nil {
			return &usageError{msg: fmt.Sprintf("--auth-file: %v", err)}
		}
		cfg.Users, err = console.ParseAuthFile(f)
		f.Close()
		if err != nil {
			return &usageError{msg: fmt.Sprintf("--auth-file %s: %v", *authFile, err)}
		}
	}
	pools, closeAll, err := connectAll(ctx, urls)
	defer closeAll()
	if err != nil {
		return err
	}
	byURL := make(map[string]*pgxpool.Pool, len(urls))
	for i, url := range urls {
		byURL[url] = pools[i]
	}
	cfg.Pool = byURL[*databases.url] // nil without --database-url
	cfg.FunctionPools = map[string]*pgxpool.Pool{}
	for function, url := range databases.own() {
		cfg.FunctionPools[function] = byURL[url]
	}
	if *natsURL != "" {
		var js jetstream.JetStream
		var closeNATS func()
		js, closeNATS, err = connectJetStream(*natsURL, "kfn console", natsSec)
		if err != nil {
			return err
		}
		defer closeNATS()
		cfg.JS = js
	}
	srv, err := console.New(cfg)
	if err != nil {
		return err
	}
	defer srv.Close()
	if err := srv.CheckDatabases(ctx); err != nil {
		return err
	}
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	if cfg.TLS {
		cert, err := tls.LoadX509KeyPair(*tlsCert, *tlsKey)
		if err != nil {
			return &usageError{msg: fmt.Sprintf("--tls-cert/--tls-key: %v", err)}
		}
		hs.TLSConfig = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return &usageError{msg: fmt.Sprintf("--listen %s: %v", *listen, err)}
	}
	scheme := "http"
	if cfg.TLS {
		scheme = "https"
	}
	mode := "read-only"
	if cfg.AllowWrites {
		mode = "writes allowed for the writer role"
	}
	fmt.Fprintf(stdout, "kfn console on %s://%s (%s)\n", scheme, ln.Addr(), mode)
	done := make(chan error, 1)
	go func() {
		if cfg.TLS {
			done <- hs.ServeTLS(ln, "", "")
		} else {
			done <- hs.Serve(ln)
		}
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := hs.Shutdown(shutdown); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
