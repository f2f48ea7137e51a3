package console

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kfn-dev/kfn/operator"
)

// A function keeps its kfn tables (cursors, dead letters, parked keys,
// audit log, outbox) in one database: its own (Config.FunctionPools), or
// else Config.Pool. Every page and action about one function uses that
// database; a page about every function reads each database and merges.
// Dead letter ids are a database's own, so an id means nothing without its
// function.

// poolOf is function's database. It is an error when function has none:
// not in FunctionPools, and no Pool.
func (s *Server) poolOf(function string) (*pgxpool.Pool, error) {
	if p, ok := s.cfg.FunctionPools[function]; ok {
		return p, nil
	}
	if s.cfg.Pool == nil {
		return nil, fmt.Errorf("function %q has no database: it is not in --function-databases, and the console has no --database-url", function)
	}
	return s.cfg.Pool, nil
}

// letterPool is the database of a dead letter of function, named by its
// id: function's, or with function "" the console's one database. With
// several databases an id alone is ambiguous.
func (s *Server) letterPool(function string) (*pgxpool.Pool, error) {
	if function != "" {
		return s.poolOf(function)
	}
	if pools := s.databases(); len(pools) == 1 {
		return pools[0], nil
	}
	return nil, errors.New("say which function the dead letter is of (function=…): the console reads several databases, and an id is one database's")
}

// owns says pool is function's database, so that a row of function read
// from pool is really function's.
func (s *Server) owns(pool *pgxpool.Pool, function string) bool {
	p, err := s.poolOf(function)
	return err == nil && p == pool
}

// databases is every database once, Pool first.
func (s *Server) databases() []*pgxpool.Pool {
	var pools []*pgxpool.Pool
	if s.cfg.Pool != nil {
		pools = append(pools, s.cfg.Pool)
	}
	for _, name := range s.ownDatabaseFunctions() {
		if p := s.cfg.FunctionPools[name]; !slices.Contains(pools, p) {
			pools = append(pools, p)
		}
	}
	return pools
}

// ownDatabaseFunctions are the functions with a database of their own,
// sorted.
func (s *Server) ownDatabaseFunctions() []string {
	return slices.Sorted(maps.Keys(s.cfg.FunctionPools))
}

// databasesOf is function's database, or every database when function
// is "".
func (s *Server) databasesOf(function string) ([]*pgxpool.Pool, error) {
	if function == "" {
		return s.databases(), nil
	}
	p, err := s.poolOf(function)
	if err != nil {
		return nil, err
	}
	return []*pgxpool.Pool{p}, nil
}

// CheckDatabases refuses a function that kfn knows (a cursor, a lane, a
// dead letter) in a database that is not its own: the console would show
// it twice and act on the wrong rows. A function moved to a database of
// its own leaves nothing behind in the old one.
func (s *Server) CheckDatabases(ctx context.Context) error {
	for _, pool := range s.databases() {
		names, err := operator.KnownFunctions(ctx, pool)
		if err != nil {
			return fmt.Errorf("list the functions of a database: %w", err)
		}
		for _, name := range names {
			if !s.owns(pool, name) {
				return fmt.Errorf("function %q is in two databases: %s, and %s too; a function keeps its kfn tables in one database (drop the old one's rows, or fix --function-databases)",
					name, s.describe(name), s.describeOther(pool))
			}
		}
	}
	return nil
}

// describe says which database function's is, in the flags' words.
func (s *Server) describe(function string) string {
	if _, ok := s.cfg.FunctionPools[function]; ok {
		return "its own in --function-databases"
	}
	return "--database-url's"
}

// describeOther says which database pool is, by the functions it serves.
func (s *Server) describeOther(pool *pgxpool.Pool) string {
	if pool == s.cfg.Pool {
		return "--database-url's"
	}
	for _, name := range s.ownDatabaseFunctions() {
		if s.cfg.FunctionPools[name] == pool {
			return fmt.Sprintf("the one --function-databases gives %s", name)
		}
	}
	return "another"
}

// readOwnRows reads the rows of page of function (every function's when
// it is "") from its database, or from each database, keeping only the
// rows of the functions whose database it is.
func readOwnRows[T any](s *Server, function string, page operator.Page, read func(*pgxpool.Pool, operator.Page) ([]T, error),
	functionOf func(T) string, order func(a, b T) int) ([]T, error) {
	pools, err := s.databasesOf(function)
	if err != nil {
		return nil, err
	}
	return readPage(pools, page, read, func(pool *pgxpool.Pool, row T) bool { return s.owns(pool, functionOf(row)) }, order)
}

// readPage reads the rows of page from each of pools, keeping those keep
// says are the database's own (nil: all), in order: from one database the
// page as it is, from several the first page.Offset+page.Limit of each,
// merged and cut to the page.
func readPage[T any](pools []*pgxpool.Pool, page operator.Page, read func(*pgxpool.Pool, operator.Page) ([]T, error),
	keep func(*pgxpool.Pool, T) bool, order func(a, b T) int) ([]T, error) {
	each := page
	if len(pools) > 1 {
		each = operator.Page{Limit: page.Limit}
		if page.Limit > 0 {
			each.Limit += page.Offset
		}
	}
	var rows []T
	for _, pool := range pools {
		these, err := read(pool, each)
		if err != nil {
			return rows, err
		}
		for _, r := range these {
			if keep == nil || keep(pool, r) {
				rows = append(rows, r)
			}
		}
	}
	if len(pools) <= 1 {
		return rows, nil
	}
	slices.SortStableFunc(rows, order)
	rows = rows[min(page.Offset, len(rows)):]
	if page.Limit > 0 {
		rows = rows[:min(page.Limit, len(rows))]
	}
	return rows, nil
}
