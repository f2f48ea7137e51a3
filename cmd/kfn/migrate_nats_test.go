package main

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/effects"
	"github.com/kfn-dev/kfn/runtime"
	"github.com/kfn-dev/kfn/runtime/kfntest"
	"github.com/kfn-dev/kfn/runtime/worker"
)

// A NATS user that may not create or change streams runs workers with
// --nats-provisioned once `kfn migrate --nats`, run by an admin user, has
// made the lease bucket and the event stream; before that, the worker is
// refused at start with a message naming what is missing and the command
// that makes it. kfn status reads the live leases with the same flags.
func TestProvisionedWorkersNeedNoJetStreamAdminRights(t *testing.T) {
	ctx := context.Background()
	sn := kfntest.StartSecureNATS(t)
	admin, _, _ := sn.User("admin")
	restricted, _, _ := sn.User("worker", "$JS.API.STREAM.CREATE.>", "$JS.API.STREAM.UPDATE.>", "$JS.API.STREAM.DELETE.>")
	pg := kfntest.Postgres(t)
	k := kfntest.Kafka(t)
	topic := k.CreateTopic(t, 2)
	name := kfntest.Name(t, "fn")
	fn := effects.Function(name, topic)
	cfg := runtime.Config{
		KafkaBrokers: k.Brokers, DatabaseURL: pg.URL, NATSURL: sn.URL,
		NATSSecurity:    runtime.NATSSecurity{Creds: restricted, CAFile: sn.CAFile},
		NATSProvisioned: true,
		LeaseBucket:     kfntest.Name(t, "leases"), EventStream: kfntest.Name(t, "EVENTS"),
		BatchSize: 100, BatchWait: 5 * time.Millisecond,
		Logger: slog.New(slog.DiscardHandler),
	}

	// The permission is real: this user cannot create a stream.
	nc, js, err := connect.NATSWith(sn.URL, "probe", runtime.NATSSecurity(cfg.NATSSecurity))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	probeCtx, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err = js.CreateStream(probeCtx, jetstream.StreamConfig{Name: kfntest.Name(t, "PROBE"), Subjects: []string{kfntest.Name(t, "probe")}})
	cancel()
	if err == nil {
		t.Fatal("the restricted user created a stream")
	}
	t.Logf("the restricted user creating a stream: %v", err)

	refused := func(what string, cfg runtime.Config, wants ...string) {
		t.Helper()
		start := time.Now()
		// A denied JetStream request times out: the server reports the
		// violation on the connection. Waiting 3 s for it is enough here.
		ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		w, err := worker.New(ctx, cfg, fn)
		if err == nil {
			w.Close()
			t.Fatalf("%s: the worker started before kfn migrate --nats", what)
		}
		took := time.Since(start)
		t.Logf("%s: refused in %s: %v", what, took.Round(time.Millisecond), err)
		for _, want := range wants {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: the refusal does not say %q", what, want)
			}
		}
		if took > 5*time.Second {
			t.Errorf("%s: refused after %s; want a fast refusal", what, took)
		}
	}
	refused("provisioned", cfg, "lease bucket "+cfg.LeaseBucket+" does not exist", "--nats-provisioned (KFN_NATS_PROVISIONED)", "kfn migrate --nats")
	unprovisioned := cfg
	unprovisioned.NATSProvisioned = false
	refused("not provisioned", unprovisioned, "may not create or change the lease bucket", "kfn migrate --nats", "--nats-provisioned (KFN_NATS_PROVISIONED)")

	code, out, stderr := kfn(t, "migrate", "--database-url", pg.URL, "--nats", "--nats-url", sn.URL,
		"--nats-creds", admin, "--nats-ca", sn.CAFile, "--lease-bucket", cfg.LeaseBucket,
		"--event-stream", cfg.EventStream, "--subjects", effects.Subject(name))
	if code != 0 {
		t.Fatalf("kfn migrate --nats: exit %d, out %q, err %q", code, out, stderr)
	}
	for _, want := range []string{"lease bucket " + cfg.LeaseBucket + " is ready (TTL 5s, 1 replicas)", "event stream " + cfg.EventStream + " is ready"} {
		if !strings.Contains(out, want) {
			t.Errorf("kfn migrate --nats printed %q; want %q", out, want)
		}
	}

	const perPartition = 40
	var msgs []kafka.Message
	for p := range 2 {
		for i := range perPartition {
			msgs = append(msgs, kafka.Message{Partition: p, Key: []byte(fmt.Sprint(i % 5)), Value: []byte(fmt.Sprintf("v-%d-%d", p, i))})
		}
	}
	k.Produce(t, topic, msgs...)
	w, err := worker.New(ctx, cfg, fn)
	if err != nil {
		t.Fatalf("a provisioned worker after kfn migrate --nats: %v", err)
	}
	stop := kfntest.Background(t, "worker", w.Run)
	var produced []effects.Produced
	for p := range 2 {
		for o := range perPartition {
			produced = append(produced, effects.Produced{Partition: int32(p), Offset: int64(o)})
		}
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		s, err := js.Stream(ctx, cfg.EventStream)
		if err == nil && s.CachedInfo().State.Msgs >= uint64(len(produced)) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the events did not reach stream %s: %v", cfg.EventStream, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The CLI reads the live leases with the same flags.
	code, out, stderr = kfn(t, "status", "--database-url", pg.URL, "--kafka-brokers", strings.Join(k.Brokers, ","),
		"--nats-url", sn.URL, "--nats-creds", restricted, "--nats-ca", sn.CAFile, "--lease-bucket", cfg.LeaseBucket, "--function", name)
	if code != 0 || strings.Count(out, "(token ") != 2 {
		t.Errorf("kfn status with --nats-creds and --nats-ca: exit %d, out %q, err %q; want both partitions' lease holders", code, out, stderr)
	}
	stop()
	rep, err := effects.Check(ctx, pg.Pool, name, topic, produced, effects.Events(js, cfg.EventStream))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("checker: %s", rep)
	if v := rep.Violations(); len(v) > 0 || rep.Expected != len(produced) {
		t.Errorf("exactly-once violated (of %d records): %s", rep.Expected, strings.Join(v, "; "))
	}
}
