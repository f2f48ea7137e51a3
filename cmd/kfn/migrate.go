package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/engine"
	"github.com/kfn-dev/kfn/internal/lease"
	"github.com/kfn-dev/kfn/internal/redact"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/outbox"
	"github.com/kfn-dev/kfn/runtime"
)

func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "grants" {
		return inCommand("migrate grants", runMigrateGrants(ctx, args[1:], stdout, stderr))
	}
	fs := newFlags("migrate", help{
		usage: []string{
			"kfn migrate --database-url URL [--function-databases F=URL,…] [--outbox wal] [--nats --nats-url URL --subjects S[,S…]]",
			"kfn migrate --database-url URL --drop-wal-outbox [--wait 2m]",
			"kfn migrate grants --function NAME --role ROLE [--tables T[,T…]] [--apply]",
		},
		commands: migrateCommands,
		text: `
Applies kfn's embedded, numbered schema migrations; safe to run again (it
says the schema is up to date). Workers refuse to start on a missing schema,
an older one, or a newer one whose migrations break them (a migration is
additive or says which older workers it breaks); the output names the oldest
worker version that runs against the result.

On a database at schema 11 or older it first copies kfn.inbox for
migration 0012 while the old workers keep running, and prints how far the
copy got; the old workers stop at the swap that ends it, and a copy that
was interrupted goes on when it runs again
(docs/production/upgrades.md).

With --function-databases it migrates every database the functions keep
their kfn tables in: --database-url's, if given, then each function's own,
each once and in that order, naming each before its output. It connects
to all of them before it changes any, and stops at the first that fails;
running it again finishes the rest.

With --outbox wal it also sets up the WAL outbox: it checks that Postgres
has wal_level=logical and creates the publication and the logical
replication slot the relay reads (it needs the REPLICATION attribute, and
says so when it lacks it). A slot that was lost is created again, and the
output says how to recover the events lost with it.

With --drop-wal-outbox it retires the WAL outbox once the workers run with
--outbox table again: from then on an emit into the WAL is refused (a
worker still in wal mode retries until it is restarted in table mode);
it waits up to --wait for the relay (kfn relay, or a worker's own) to
relay every event emitted before, then drops the slot and the
publication. Without a relay reading the slot it says what to start and
exits 1 after --wait, keeping the retirement: run it again.

With --nats it also creates, once and with --nats-replicas, the JetStream
state the workers use: the lease bucket and the event stream capturing
--subjects (an existing stream gets the subjects it lacks). Run it with a
NATS user allowed to create streams; workers started with --nats-provisioned
then need no such right.`,
		examples: `
kfn migrate --database-url postgres://kfn@db:5432/kfn
kfn migrate --database-url postgres://kfn@db:5432/kfn --function-databases ledger=postgres://kfn@ledger-db:5432/kfn
DATABASE_URL=postgres://kfn@db:5432/kfn kfn migrate
kfn migrate --outbox wal --database-url postgres://kfn@db:5432/kfn
kfn migrate --drop-wal-outbox --wait 5m --database-url postgres://kfn@db:5432/kfn
kfn migrate --nats --nats-url nats://nats:4222 --nats-creds admin.creds --nats-replicas 3 --subjects 'orders.>,payments.>'`,
	}, stderr)
	dbs := bindDatabases(fs)
	withNATS := fs.Bool("nats", false, "also create the lease bucket and the event stream in NATS (see --nats-provisioned)")
	var cfg runtime.Config
	bindNATSState(fs.settings, &cfg)
	subjects := bind(fs, settings.RelaySubjects)
	outboxMode := bind(fs, settings.Outbox)
	dropWAL := fs.Bool("drop-wal-outbox", false, "retire the WAL outbox: refuse new emits, wait for the relay to drain the slot, drop the slot and the publication")
	drainWait := fs.Duration("wait", 2*time.Minute, "with --drop-wal-outbox: how long to wait for the transactions that emitted to end, and then for the relay to drain the slot")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *dropWAL && outbox.Mode(*outboxMode) == outbox.ModeWAL {
		return &usageError{msg: fmt.Sprintf("--drop-wal-outbox retires the WAL outbox and --%s wal (%s) sets it up: use one of them", settings.Outbox.Flag, settings.Outbox.Env)}
	}
	if *drainWait <= 0 {
		return &usageError{msg: fmt.Sprintf("--wait is %s: give a positive duration such as 2m", *drainWait)}
	}
	if *withNATS {
		if err := requiredSetting(settings.NATSURL, cfg.NATSURL); err != nil {
			return err
		}
		if len(*subjects) == 0 {
			return &usageError{msg: fmt.Sprintf("--nats needs --%s (%s): the subjects the functions emit on, which the event stream must capture, e.g. orders.>,payments.>", settings.RelaySubjects.Flag, settings.RelaySubjects.Env)}
		}
	}
	urls, err := dbs.all()
	if err != nil {
		return err
	}
	pools, closeAll, err := connectAll(ctx, urls)
	defer closeAll()
	if err != nil {
		return err
	}
	for i, pool := range pools {
		if len(pools) > 1 {
			fmt.Fprintf(stdout, "kfn: database %s\n", redact.Redact(urls[i]))
		}
		if err := migrateDatabase(ctx, pool, outbox.Mode(*outboxMode), *dropWAL, *drainWait, stdout); err != nil {
			if len(pools) > 1 {
				return fmt.Errorf("database %s: %w", redact.Redact(urls[i]), err)
			}
			return err
		}
	}
	if !*withNATS {
		return nil
	}
	return provisionNATS(ctx, tokenFloorOf(pools), cfg.WithDefaults(), *subjects, stdout)
}

// migrateDatabase applies the schema migrations to one database, then
// sets up the WAL outbox (mode wal) or retires it (dropWAL).
func migrateDatabase(ctx context.Context, pool *pgxpool.Pool, mode outbox.Mode, dropWAL bool, drainWait time.Duration, stdout io.Writer) error {
	applied, err := schema.MigrateReporting(ctx, pool, schema.PrintProgress(stdout, ""))
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, schema.Outcome(applied))
	if mode == outbox.ModeWAL {
		if err := setUpWAL(ctx, pool, stdout); err != nil {
			return err
		}
	}
	if dropWAL {
		return dropWALOutbox(ctx, pool, drainWait, time.Second, stdout)
	}
	return nil
}

// tokenFloorOf is the largest token stored in any of pools' databases
// (engine.TokenFloor of each): a lease bucket shared by functions on
// several databases must start above the fences of all of them.
func tokenFloorOf(pools []*pgxpool.Pool) func(context.Context) (uint64, error) {
	return func(ctx context.Context) (uint64, error) {
		var largest uint64
		for _, pool := range pools {
			floor, err := engine.TokenFloor(pool)(ctx)
			if err != nil {
				return 0, err
			}
			largest = max(largest, floor)
		}
		return largest, nil
	}
}

// provisionNATS creates the lease bucket and the event stream that
// workers started with --nats-provisioned expect, or checks that they
// exist with cfg's replicas and TTL. A bucket it creates starts its tokens
// above tokenFloor.
func provisionNATS(ctx context.Context, tokenFloor func(context.Context) (uint64, error), cfg runtime.Config, subjects []string, stdout io.Writer) error {
	js, closeNATS, err := connectJetStream(cfg.NATSURL, appName, &cfg.NATSSecurity)
	if err != nil {
		return err
	}
	defer closeNATS()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	_, err = lease.OpenStore(ctx, js, lease.StoreConfig{
		Bucket: cfg.LeaseBucket, TTL: cfg.LeaseTTL, Replicas: cfg.NATSReplicas,
		TokenFloor: tokenFloor, Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		return fmt.Errorf("lease bucket in NATS at %s: %w", redact.Redact(cfg.NATSURL), engine.ReplicasSetting(err, cfg.NATSReplicas))
	}
	fmt.Fprintf(stdout, "lease bucket %s is ready (TTL %s, %d replicas)\n", cfg.LeaseBucket, cfg.LeaseTTL, cfg.NATSReplicas)
	all, err := outbox.ExtendStream(ctx, js, cfg.EventStream, subjects,
		outbox.StreamLimits{Duplicates: cfg.EventDedup, MaxAge: cfg.EventRetention, Replicas: cfg.NATSReplicas})
	if err != nil {
		return fmt.Errorf("event stream in NATS at %s: %w", redact.Redact(cfg.NATSURL), engine.ReplicasSetting(err, cfg.NATSReplicas))
	}
	fmt.Fprintf(stdout, "event stream %s is ready (subjects %s, %d replicas)\n", cfg.EventStream, strings.Join(all, ","), cfg.NATSReplicas)
	return nil
}

// appName is the application_name of the Postgres sessions of the running
// command: "kfn <command>" (run sets it).
var appName = "kfn"

// openDatabase is connectPostgres for a command that needs
// --database-url: without it, a usage error naming the variable too.
func openDatabase(ctx context.Context, dbURL string) (*pgxpool.Pool, error) {
	if err := requiredSetting(settings.DatabaseURL, dbURL); err != nil {
		return nil, err
	}
	return connectPostgres(ctx, dbURL)
}

// connectPostgres opens a pool and checks that the server answers; a URL
// that does not parse is a usage error.
func connectPostgres(ctx context.Context, dbURL string) (*pgxpool.Pool, error) {
	pool, err := connect.Postgres(ctx, dbURL, appName, nil)
	var urlErr *connect.URLError
	if errors.As(err, &urlErr) {
		return nil, &usageError{msg: urlErr.Error()}
	}
	return pool, err
}

// setUpWAL sets up the WAL outbox (outbox.SetUpWAL) and says what it did;
// a slot made again after a loss comes with the way to recover.
func setUpWAL(ctx context.Context, pool *pgxpool.Pool, stdout io.Writer) error {
	setup, err := outbox.SetUpWAL(ctx, pool)
	if err != nil {
		return fmt.Errorf("set up the WAL outbox: %w", err)
	}
	made := func(created bool) string {
		if created {
			return "created"
		}
		return "present"
	}
	fmt.Fprintf(stdout, "kfn: WAL outbox: replication slot %s %s, publication %s %s\n",
		setup.Slot, made(setup.CreatedSlot), setup.Publication, made(setup.CreatedPublication))
	if setup.Recreated {
		since := "an unknown time (no reader ever confirmed it)"
		if !setup.LostSince.IsZero() {
			since = setup.LostSince.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(stdout, "kfn: WARNING: the slot had been lost: events emitted after its last confirmation, %s, and not relayed before it went are lost. "+
			"Recover them by replaying the functions that emit from that time with their event ids kept (kfn replay --function F --topic T --from-time %s --reexecute --keep-event-ids): "+
			"the stream and the downstream inboxes drop the events they already have (docs/production/wal-outbox.md, \"Slot loss\").\n", since, since)
	}
	return nil
}
