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
	"github.com/segmentio/kafka-go"

	"github.com/kfn-dev/kfn/internal/devstack"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/internal/redact"
	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/internal/settings"
	"github.com/kfn-dev/kfn/runtime"
)

// stack is the set of services kfn dev and kfn bench run against: the ones
// given by flags, and embedded or throwaway ones for the rest.
type stack struct {
	DatabaseURL string
	NATSURL     string
	Brokers     []string
	Kafka       runtime.KafkaSecurity // how to connect to Brokers: TLS, SASL (none for the embedded broker)
	stops       []func()
}

// serviceFlags are the flags of the commands that run a stack (dev, bench):
// the services they name are used, the others are started in this process.
type serviceFlags struct {
	databaseURL, natsURL *string
	brokers              *[]string
	kafka                *runtime.KafkaSecurity
}

func addServiceFlags(fs *flagSet) serviceFlags {
	db, nats, kafka := settings.DatabaseURL, settings.NATSURL, settings.KafkaBrokers
	db.DefaultText = "a throwaway cluster started here"
	nats.DefaultText = "an embedded server"
	kafka.DefaultText = "an embedded broker"
	return serviceFlags{databaseURL: bind(fs, db), natsURL: bind(fs, nats), brokers: bind(fs, kafka), kafka: bindKafkaSecurity(fs)}
}

// start starts the stack and migrates its database. The caller stops the
// stack and closes the pool.
func (f serviceFlags) start(ctx context.Context, out io.Writer, log *slog.Logger) (*stack, *pgxpool.Pool, error) {
	st, err := f.startServices(ctx, out, log)
	if err != nil {
		return nil, nil, err
	}
	pool, err := migrated(ctx, st)
	return st, pool, err
}

// startServices starts the stack without touching its database. The
// caller stops the stack.
func (f serviceFlags) startServices(ctx context.Context, out io.Writer, log *slog.Logger) (*stack, error) {
	if len(*f.brokers) > 0 {
		if err := kafkaconn.Check(*f.kafka); err != nil {
			return nil, err
		}
	}
	st, err := startStack(ctx, *f.databaseURL, *f.natsURL, *f.brokers, out, log)
	if err != nil {
		return nil, err
	}
	if len(*f.brokers) > 0 {
		st.Kafka = *f.kafka
	}
	return st, nil
}

// migrated connects to the stack's database and migrates it; on an error
// it stops the stack.
func migrated(ctx context.Context, st *stack) (*pgxpool.Pool, error) {
	pool, err := connectPostgres(ctx, st.DatabaseURL)
	if err != nil {
		st.stop()
		return nil, err
	}
	if _, err := schema.Migrate(ctx, pool); err != nil {
		pool.Close()
		st.stop()
		return nil, err
	}
	return pool, nil
}

// startStack starts whatever the given URLs leave out. out receives one line
// per service saying where it is.
func startStack(ctx context.Context, dbURL, natsURL string, brokers []string, out io.Writer, log *slog.Logger) (*stack, error) {
	s := &stack{DatabaseURL: dbURL, NATSURL: natsURL, Brokers: brokers}
	ok := false
	defer func() {
		if !ok {
			s.stop()
		}
	}()
	if s.DatabaseURL == "" {
		pg, err := devstack.StartPostgres(ctx, devstack.PostgresOptions{Logger: log})
		if err != nil {
			return nil, fmt.Errorf("%w\n(or point --database-url / DATABASE_URL at a running Postgres)", err)
		}
		s.stops = append(s.stops, func() { pg.Stop() })
		s.DatabaseURL = pg.URL
		fmt.Fprintf(out, "postgres  throwaway cluster at %s\n", pg.URL)
	} else {
		fmt.Fprintf(out, "postgres  %s (from --database-url)\n", redact.Redact(s.DatabaseURL))
	}
	if s.NATSURL == "" {
		n, err := devstack.StartNATS("")
		if err != nil {
			return nil, err
		}
		s.stops = append(s.stops, n.Stop)
		s.NATSURL = n.URL
		fmt.Fprintf(out, "nats      embedded server with JetStream at %s\n", n.URL)
	} else {
		fmt.Fprintf(out, "nats      %s\n", redact.Redact(s.NATSURL))
	}
	if len(s.Brokers) == 0 {
		k, err := devstack.StartKafka(devstack.KafkaOptions{})
		if err != nil {
			return nil, err
		}
		s.stops = append(s.stops, k.Stop)
		s.Brokers = k.Brokers
		fmt.Fprintf(out, "kafka     embedded broker at %v\n", k.Brokers)
	} else {
		fmt.Fprintf(out, "kafka     %v\n", s.Brokers)
	}
	ok = true
	return s, nil
}

// printExports prints the stack's addresses as shell export lines, so that
// another terminal (kfn produce, kfn tail, kfn status, a function binary)
// reaches the same stack. The throwaway cluster's and the embedded server's
// URLs hold no password; a given URL that holds a password or a token is
// not printed (the terminal's scrollback and logs would keep it): the
// user, who gave it, exports it themselves.
func printExports(out io.Writer, s *stack) {
	fmt.Fprintln(out, "# in another terminal, to use this stack:")
	for _, e := range []struct{ env, fileEnv, value string }{
		{settings.DatabaseURL.Env, settings.DatabaseURL.FileEnv(), s.DatabaseURL},
		{settings.NATSURL.Env, settings.NATSURL.FileEnv(), s.NATSURL},
	} {
		if redact.HasSecret(e.value) {
			fmt.Fprintf(out, "# %s is not printed: it holds a password or a token; export it (or %s) yourself\n", e.env, e.fileEnv)
			continue
		}
		fmt.Fprintf(out, "export %s=%s\n", e.env, shellQuote(e.value))
	}
	fmt.Fprintf(out, "export %s=%s\n", settings.KafkaBrokers.Env, shellQuote(strings.Join(s.Brokers, ",")))
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

func (s *stack) stop() {
	for i := len(s.stops) - 1; i >= 0; i-- {
		s.stops[i]()
	}
	s.stops = nil
}

// ensureTopic creates topic with the given partitions unless it exists.
func ensureTopic(ctx context.Context, brokers []string, sec runtime.KafkaSecurity, topic string, partitions int) error {
	client, closeClient, err := kafkaClient(brokers, sec)
	if err != nil {
		return err
	}
	defer closeClient()
	resp, err := client.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{
		Topic: topic, NumPartitions: partitions, ReplicationFactor: 1,
	}}})
	if err != nil {
		return fmt.Errorf("create topic %s on %v: %w", topic, brokers, kafkaconn.Explain(err, brokers, sec))
	}
	if err := resp.Errors[topic]; err != nil && !errors.Is(err, kafka.TopicAlreadyExists) {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	// A new topic needs a moment before its partitions have leaders.
	for deadline := time.Now().Add(30 * time.Second); ; {
		md, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
		if err == nil && len(md.Topics) == 1 && md.Topics[0].Error == nil && len(md.Topics[0].Partitions) > 0 {
			ready := true
			for _, p := range md.Topics[0].Partitions {
				ready = ready && p.Leader.Host != ""
			}
			if ready {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("topic %s has no leaders after 30s (last error: %v)", topic, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
