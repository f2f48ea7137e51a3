package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	neturl "net/url"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/kfn-dev/kfn/internal/redact"
)

// kfn bench never writes into the database it is pointed at: it creates a
// database of its own on the same server (kfn_bench_<random>), migrates
// and benchmarks there, and drops it at the end, also when the run is
// interrupted (SIGINT or SIGTERM cancel its context; the drop runs on a
// context of its own). A run that was killed leaves its database behind:
// the next run drops every scratch database that no session uses, known
// by its comment, before it creates its own. So a user's orders table, a
// kfn installation's inbox and outbox, and an earlier run's rows are never
// touched, and two runs in a row start alike.

// scratchComment marks the databases kfn bench creates, so that it drops
// no other.
const scratchComment = "kfn bench scratch database: dropped when its run ends"

// scratchDatabase is the benchmark's own database.
type scratchDatabase struct {
	Name string
	URL  string // the given URL, with the scratch database in it
	// server is the given URL: the drop connects there (a database cannot
	// be dropped from a session inside it).
	server string
	// held is a session in the database for as long as the run lasts, so
	// that another run's sweep of left databases never takes it for one.
	held *pgx.Conn
}

// createScratchDatabase drops the scratch databases earlier runs left
// behind, then creates one for this run on the server of serverURL. It
// needs the CREATEDB privilege.
func createScratchDatabase(ctx context.Context, serverURL string, out io.Writer) (*scratchDatabase, error) {
	conn, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		return nil, fmt.Errorf("connect to Postgres: %s", redact.Scrub(err.Error(), serverURL))
	}
	defer conn.Close(context.Background())
	left, err := dropLeftScratchDatabases(ctx, conn)
	if err != nil {
		return nil, err
	}
	if len(left) > 0 {
		fmt.Fprintf(out, "dropped %d scratch database(s) an interrupted kfn bench left behind: %s\n", len(left), strings.Join(left, ", "))
	}
	var random [6]byte
	if _, err := rand.Read(random[:]); err != nil {
		return nil, err
	}
	name := "kfn_bench_" + hex.EncodeToString(random[:])
	quoted := pgx.Identifier{name}.Sanitize()
	if _, err := conn.Exec(ctx, `CREATE DATABASE `+quoted); err != nil {
		return nil, fmt.Errorf("create the benchmark's own database %s (kfn bench writes nowhere else; its role needs CREATEDB): %w", name, err)
	}
	db := &scratchDatabase{Name: name, URL: withDatabase(serverURL, name), server: serverURL}
	if db.held, err = pgx.Connect(ctx, db.URL); err != nil {
		db.drop()
		return nil, fmt.Errorf("connect to the benchmark's database %s: %s", name, redact.Scrub(err.Error(), db.URL))
	}
	// Marked only once a session holds it.
	if _, err := conn.Exec(ctx, `COMMENT ON DATABASE `+quoted+` IS '`+scratchComment+`'`); err != nil {
		db.drop()
		return nil, fmt.Errorf("mark the benchmark's database %s: %w", name, err)
	}
	return db, nil
}

// dropLeftScratchDatabases drops the scratch databases that no session
// uses, and returns their names.
func dropLeftScratchDatabases(ctx context.Context, conn *pgx.Conn) ([]string, error) {
	rows, err := conn.Query(ctx, `
SELECT d.datname FROM pg_database d
 WHERE d.datname LIKE 'kfn\_bench\_%' AND shobj_description(d.oid, 'pg_database') = $1
   AND NOT EXISTS (SELECT FROM pg_stat_activity a WHERE a.datid = d.oid)
 ORDER BY 1`, scratchComment)
	if err != nil {
		return nil, fmt.Errorf("list the scratch databases of earlier runs: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("list the scratch databases of earlier runs: %w", err)
	}
	var dropped []string
	for _, name := range names {
		// Without FORCE: a run that connects in between keeps its database.
		if _, err := conn.Exec(ctx, `DROP DATABASE IF EXISTS `+pgx.Identifier{name}.Sanitize()); err == nil {
			dropped = append(dropped, name)
		}
	}
	return dropped, nil
}

// drop drops the scratch database, ending the sessions still in it, and
// first the replication slots made in it (the WAL outbox's): DROP
// DATABASE refuses while a slot of the database is read, and a slot left
// behind would hold the server's WAL forever. It runs on a context of its
// own, so that an interrupted run cleans up.
func (db *scratchDatabase) drop() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if db.held != nil {
		db.held.Close(ctx)
	}
	conn, err := pgx.Connect(ctx, db.server)
	if err != nil {
		return fmt.Errorf("drop the benchmark's database %s: %s", db.Name, redact.Scrub(err.Error(), db.server))
	}
	defer conn.Close(ctx)
	if err := dropSlots(ctx, conn, db.Name); err != nil {
		return fmt.Errorf("drop the benchmark's database %s: %w", db.Name, err)
	}
	if _, err := conn.Exec(ctx, `DROP DATABASE IF EXISTS `+pgx.Identifier{db.Name}.Sanitize()+` WITH (FORCE)`); err != nil {
		return fmt.Errorf("drop the benchmark's database %s: %w", db.Name, err)
	}
	return nil
}

// dropSlots drops the replication slots of database, ending the sessions
// that read them (a relay's walsender may outlive its stopped relay for a
// moment).
func dropSlots(ctx context.Context, conn *pgx.Conn, database string) error {
	for {
		if _, err := conn.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active`, database); err != nil {
			return fmt.Errorf("end the sessions reading its replication slots: %w", err)
		}
		_, dropErr := conn.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1 AND NOT active`, database)
		var left int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE database = $1`, database).Scan(&left); err != nil {
			return fmt.Errorf("drop its replication slots: %w", err)
		}
		if left == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("drop its replication slots: %d left (%v): %w", left, dropErr, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// withDatabase is a Postgres connection string (URL or key=value) naming
// database name instead of its own.
func withDatabase(conn, name string) string {
	if u, err := neturl.Parse(conn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + name
		u.RawPath = ""
		q := u.Query()
		if q.Has("dbname") {
			q.Set("dbname", name)
			u.RawQuery = q.Encode()
		}
		return u.String()
	}
	return conn + " dbname=" + name // a later key wins
}
