package devstack

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
)

// ErrPostgresNotInstalled means no PostgreSQL server binaries (initdb and
// postgres) were found. Its message says what to install.
var ErrPostgresNotInstalled = errors.New("PostgreSQL server binaries (initdb, postgres) not found on PATH or in /usr/lib/postgresql/*/bin: " +
	"install them (Debian/Ubuntu: `apt-get install postgresql`; macOS: `brew install postgresql@16`) " +
	"or point kfn at an existing server with DATABASE_URL")

// pgBinaries are the PostgreSQL programs a throwaway cluster needs.
type pgBinaries struct {
	initdb   string
	postgres string
}

// findPostgresBinaries looks in dir if it is set, else on PATH, else in the
// highest-versioned well-known install folder (Debian's /usr/lib/postgresql/N/bin,
// Homebrew's postgresql@N).
func findPostgresBinaries(dir string) (pgBinaries, error) {
	if dir != "" {
		b := pgBinaries{initdb: filepath.Join(dir, "initdb"), postgres: filepath.Join(dir, "postgres")}
		for _, p := range []string{b.initdb, b.postgres} {
			if _, err := os.Stat(p); err != nil {
				return pgBinaries{}, fmt.Errorf("PostgresOptions.BinDir %s: %w", dir, err)
			}
		}
		return b, nil
	}
	initdb, errI := exec.LookPath("initdb")
	postgres, errP := exec.LookPath("postgres")
	if errI == nil && errP == nil {
		return pgBinaries{initdb: initdb, postgres: postgres}, nil
	}
	// initdb alone on PATH is common (Debian links only some programs): take
	// the postgres program from the folder initdb really lives in.
	if errI == nil {
		if real, err := filepath.EvalSymlinks(initdb); err == nil {
			p := filepath.Join(filepath.Dir(real), "postgres")
			if _, err := os.Stat(p); err == nil {
				return pgBinaries{initdb: initdb, postgres: p}, nil
			}
		}
	}
	for _, dir := range versionedBinDirs() {
		b := pgBinaries{initdb: filepath.Join(dir, "initdb"), postgres: filepath.Join(dir, "postgres")}
		_, e1 := os.Stat(b.initdb)
		_, e2 := os.Stat(b.postgres)
		if e1 == nil && e2 == nil {
			return b, nil
		}
	}
	return pgBinaries{}, ErrPostgresNotInstalled
}

// versionedBinDirs lists candidate bin folders, highest PostgreSQL version first.
func versionedBinDirs() []string {
	type cand struct {
		dir     string
		version float64
	}
	var cands []cand
	for _, pattern := range []string{
		"/usr/lib/postgresql/*/bin",
		"/usr/pgsql-*/bin",
		"/opt/homebrew/opt/postgresql@*/bin",
		"/usr/local/opt/postgresql@*/bin",
	} {
		matches, _ := filepath.Glob(pattern)
		for _, m := range matches {
			cands = append(cands, cand{dir: m, version: versionIn(m)})
		}
	}
	sort.SliceStable(cands, func(i, j int) bool { return cands[i].version > cands[j].version })
	dirs := make([]string, len(cands))
	for i, c := range cands {
		dirs[i] = c.dir
	}
	return dirs
}

// versionIn extracts the PostgreSQL major version from an install path such
// as /usr/lib/postgresql/15/bin or /opt/homebrew/opt/postgresql@16/bin.
func versionIn(path string) float64 {
	for _, part := range strings.Split(path, string(filepath.Separator)) {
		if i := strings.LastIndexAny(part, "@-"); i >= 0 {
			part = part[i+1:]
		}
		if v, err := strconv.ParseFloat(part, 64); err == nil {
			return v
		}
	}
	return 0
}

// serverUser says who runs initdb and postgres. PostgreSQL refuses to run as
// root, so as root both run as the `postgres` system user and the data
// directory is handed to that user.
type serverUser struct {
	cred     *syscall.Credential // nil: the current user
	uid, gid int
	name     string
}

func lookupServerUser() (serverUser, error) {
	if os.Geteuid() != 0 {
		return serverUser{uid: -1, gid: -1}, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return serverUser{}, fmt.Errorf("running as root, and PostgreSQL refuses to run as root: it must run as the `postgres` user, which does not exist (%v); "+
			"install the postgresql package (it creates that user), create it with `useradd --system --user-group postgres`, "+
			"run as an ordinary user, or use an existing server through DATABASE_URL", err)
	}
	uid, err1 := strconv.Atoi(u.Uid)
	gid, err2 := strconv.Atoi(u.Gid)
	if err1 != nil || err2 != nil {
		return serverUser{}, fmt.Errorf("user postgres has a non-numeric uid %q or gid %q", u.Uid, u.Gid)
	}
	return serverUser{
		cred: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: false},
		uid:  uid, gid: gid, name: "postgres",
	}, nil
}

// prepareDir creates dir (mode 0700, as PostgreSQL demands) and hands it to the
// server user. As root it also checks that the postgres user can reach dir:
// a folder under a 0700 root-owned parent (t.TempDir, /root) cannot be used.
func (u serverUser) prepareDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("chmod 0700 %s: %w", dir, err)
	}
	if u.cred == nil {
		return nil
	}
	if err := os.Chown(dir, u.uid, u.gid); err != nil {
		return fmt.Errorf("hand %s to user %s: %w", dir, u.name, err)
	}
	for parent := filepath.Dir(dir); ; parent = filepath.Dir(parent) {
		fi, err := os.Stat(parent)
		if err != nil {
			return fmt.Errorf("stat %s: %w", parent, err)
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		searchable := fi.Mode().Perm()&0o001 != 0 ||
			(ok && int(st.Uid) == u.uid && fi.Mode().Perm()&0o100 != 0) ||
			(ok && int(st.Gid) == u.gid && fi.Mode().Perm()&0o010 != 0)
		if !searchable {
			return fmt.Errorf("the postgres server runs as user %s (we are root) and cannot reach %s: its parent %s has mode %v; "+
				"put the data directory under a world-searchable folder such as /tmp, or `chmod o+x %s`",
				u.name, dir, parent, fi.Mode().Perm(), parent)
		}
		if parent == filepath.Dir(parent) {
			return nil
		}
	}
}
