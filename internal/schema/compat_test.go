package schema_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

func TestMigrationMarkersAreReadFromTheFirstLine(t *testing.T) {
	cases := []struct {
		sql     string
		want    int
		wantErr bool
	}{
		{"-- kfn:additive\nALTER TABLE t ADD COLUMN c text;", 0, false},
		{"-- kfn:breaks-before 7\nDROP TABLE t;", 7, false},
		{"-- kfn:breaks-before 3  \r\n", 3, false},
		{"-- kfn:breaks-before 8\n", 0, true}, // newer than the migration itself
		{"-- kfn:breaks-before 0\n", 0, true},
		{"-- kfn:breaks-before seven\n", 0, true},
		{"-- adds a column\n-- kfn:additive\n", 0, true}, // not on the first line
		{"", 0, true},
	}
	for _, tc := range cases {
		got, err := schema.Compatibility(schema.Migration{Version: 7, Name: "0007_x", SQL: tc.sql})
		if got != tc.want || (err != nil) != tc.wantErr {
			t.Errorf("marker of %q = %d, %v; want %d (error %v)", tc.sql, got, err, tc.want, tc.wantErr)
		}
		if err != nil && !strings.Contains(err.Error(), "0007_x must start with `-- kfn:additive` or `-- kfn:breaks-before N`") {
			t.Errorf("error %q does not say what the migration must start with", err)
		}
	}
}

// The migrator records every applied migration's marker in the database,
// those applied before the column existed too, so that an older binary can
// read what migrations it does not know break.
func TestMigrateRecordsWhatEachMigrationBreaks(t *testing.T) {
	db := kfntest.PostgresEmpty(t)
	ctx := context.Background()
	if _, err := schema.MigrateTo(ctx, db.Pool, 7); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	recorded := map[int]int{}
	rows, err := db.Pool.Query(ctx, `SELECT version, coalesce(breaks_before, 0) FROM kfn.schema_migrations`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var v, b int
		if err := rows.Scan(&v, &b); err != nil {
			t.Fatal(err)
		}
		recorded[v] = b
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	ms := schema.Migrations()
	if len(recorded) != len(ms) {
		t.Fatalf("recorded %v for %d migrations", recorded, len(ms))
	}
	breaking := 0
	for _, m := range ms {
		if b, ok := recorded[m.Version]; !ok || b != m.BreaksBefore {
			t.Errorf("%s: recorded breaks_before %d (present %v), want %d", m.Name, b, ok, m.BreaksBefore)
		}
		if m.BreaksBefore > 0 {
			breaking++
		}
	}
	if breaking == 0 || breaking == len(ms) {
		t.Errorf("%d of %d migrations break older workers; the markers were not read", breaking, len(ms))
	}
}

// A worker runs against its own schema and a newer one whose later
// migrations are additive or break only workers older than it; a newer
// migration that breaks it makes it refuse, saying which versions it runs
// against and what to do. The newer migrations are rows written as a newer
// migrator writes them: this binary does not know them.
func TestCheckAcceptsTheCompatibleRangeOnly(t *testing.T) {
	db := kfntest.Postgres(t)
	ctx := context.Background()
	own := schema.Latest()
	newer := func(version, breaksBefore int) {
		t.Helper()
		_, err := db.Pool.Exec(ctx, `INSERT INTO kfn.schema_migrations (version, name, breaks_before) VALUES ($1, $2, nullif($3, 0))`,
			version, "newer_"+strings.Repeat("x", version-own), breaksBefore)
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := schema.Check(ctx, db.Pool); err != nil {
		t.Fatalf("own version: %v", err)
	}
	newer(own+1, 0)   // additive
	newer(own+2, own) // breaks only workers older than this one
	if err := schema.Check(ctx, db.Pool); err != nil {
		t.Fatalf("newer schema with compatible migrations: %v", err)
	}
	newer(own+3, own+3)
	newer(own+4, own+4)
	err := schema.Check(ctx, db.Pool)
	var verr *schema.VersionError
	if !errors.As(err, &verr) || verr.CompatibleUpTo != own+2 || verr.Breaking != "newer_xxx" || verr.BreaksBefore != own+3 {
		t.Fatalf("Check = %#v (%v); want the range %d to %d, broken by newer_xxx", err, err, own, own+2)
	}
	for _, want := range []string{"runs against versions", "newer_xxx breaks workers", "upgrade this binary to the release built for schema version"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not contain %q", err, want)
		}
	}
	t.Logf("the refusal reads: %v", err)
}

func TestCheckRefusesAnOlderSchemaUntilMigrated(t *testing.T) {
	db := kfntest.PostgresEmpty(t)
	ctx := context.Background()
	if _, err := schema.MigrateTo(ctx, db.Pool, 6); err != nil {
		t.Fatal(err)
	}
	err := schema.Check(ctx, db.Pool)
	var verr *schema.VersionError
	if !errors.As(err, &verr) || verr.Database != 6 || !strings.Contains(err.Error(), "run `kfn migrate`") {
		t.Fatalf("Check on version 6 = %v; want a VersionError telling to run kfn migrate", err)
	}
}

// OldestCompatible agrees with the rule applied by hand: the oldest
// version every later migration leaves working.
func TestOldestCompatibleFollowsTheMarkers(t *testing.T) {
	ms := schema.Migrations()
	want := schema.Latest()
	for i := len(ms) - 2; i >= 0; i-- {
		ok := true
		for _, later := range ms[i+1:] {
			ok = ok && later.BreaksBefore <= ms[i].Version
		}
		if !ok {
			break
		}
		want = ms[i].Version
	}
	if got := schema.OldestCompatible(); got != want || got > schema.Latest() {
		t.Errorf("OldestCompatible = %d, want %d", got, want)
	}
}
