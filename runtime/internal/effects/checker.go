package effects

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Produced is one record the test produced: where it landed.
type Produced struct {
	Partition int32
	Offset    int64
}

// Report counts what went wrong. Every count must be zero.
type Report struct {
	Expected    int // records that should have an effect
	Applied     int // effect rows found
	Lost        int // expected records with no effect and no dead letter
	Duplicated  int // extra effect rows for one record
	Reordered   int // effects that committed before an effect of a lower offset of the same partition
	Unexpected  int // effects of records never produced
	DeadLetters int // records dead-lettered (they are not lost)
	// StaleEpochs counts inbox rows committed with a fencing token lower
	// than the token of a lower offset of the same partition: a commit by
	// an older owner after a newer owner had committed (invariant I4).
	StaleEpochs int
}

// OK reports whether nothing was lost, duplicated, reordered or invented,
// and no commit came from an owner that had been fenced.
func (r Report) OK() bool {
	return r.Lost == 0 && r.Duplicated == 0 && r.Reordered == 0 && r.Unexpected == 0 && r.StaleEpochs == 0
}

func (r Report) String() string {
	return fmt.Sprintf("expected=%d applied=%d dead_lettered=%d lost=%d duplicated=%d reordered=%d unexpected=%d stale_epochs=%d",
		r.Expected, r.Applied, r.DeadLetters, r.Lost, r.Duplicated, r.Reordered, r.Unexpected, r.StaleEpochs)
}

// Table is the quoted name of fn's effects table, for programs that write
// effects without the runtime (the naive consumer the fault tests compare
// kfn with).
func Table(fn string) string { return table(fn) }

// Check compares the effects of function fn on topic with produced.
func Check(ctx context.Context, pool *pgxpool.Pool, fn, topic string, produced []Produced) (Report, error) {
	rows, err := pool.Query(ctx, `SELECT partition, "offset" FROM `+table(fn)+` WHERE topic = $1 ORDER BY id`, topic)
	if err != nil {
		return Report{}, fmt.Errorf("read effects: %w", err)
	}
	type key struct {
		p int32
		o int64
	}
	seen := map[key]int{}
	lastOffset := map[int32]int64{}
	var rep Report
	for rows.Next() {
		var k key
		if err := rows.Scan(&k.p, &k.o); err != nil {
			return Report{}, err
		}
		rep.Applied++
		seen[k]++
		if last, ok := lastOffset[k.p]; ok && k.o < last {
			rep.Reordered++
		}
		lastOffset[k.p] = max(lastOffset[k.p], k.o)
	}
	if err := rows.Err(); err != nil {
		return Report{}, err
	}
	dead := map[key]bool{}
	dlRows, err := pool.Query(ctx, `SELECT partition, "offset" FROM kfn.dead_letters WHERE consumer = $1 AND topic = $2`, fn, topic)
	if err != nil {
		return Report{}, fmt.Errorf("read dead letters: %w", err)
	}
	for dlRows.Next() {
		var k key
		if err := dlRows.Scan(&k.p, &k.o); err != nil {
			return Report{}, err
		}
		dead[k] = true
	}
	if err := dlRows.Err(); err != nil {
		return Report{}, err
	}
	expected := map[key]bool{}
	for _, p := range produced {
		expected[key{p.Partition, p.Offset}] = true
	}
	rep.Expected = len(expected)
	for k := range expected {
		n := seen[k]
		switch {
		case dead[k]:
			rep.DeadLetters++
			rep.Duplicated += n // a dead-lettered record must have no effect
		case n == 0:
			rep.Lost++
		case n > 1:
			rep.Duplicated += n - 1
		}
	}
	for k, n := range seen {
		if !expected[k] {
			rep.Unexpected += n
		}
	}
	if rep.StaleEpochs, err = staleEpochs(ctx, pool, fn, topic); err != nil {
		return Report{}, err
	}
	return rep, nil
}

// staleEpochSQL finds the inbox rows of one consumer and topic whose epoch
// (the token of the transaction that wrote them) is lower than the highest
// epoch of any lower offset of the same partition. Offsets of a partition
// commit in order, so such a row was committed by an older owner after a
// newer owner had committed: the fence let a zombie through.
const staleEpochSQL = `
SELECT count(*) FROM (
    SELECT epoch, max(epoch) OVER (PARTITION BY partition ORDER BY "offset"
                                   ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS newest_before
      FROM kfn.inbox
     WHERE consumer = $1 AND topic = $2
) rows
WHERE epoch < newest_before`

// staleEpochs counts the commits of fn on topic that an older owner made
// after a newer owner had committed; see Report.StaleEpochs.
func staleEpochs(ctx context.Context, pool *pgxpool.Pool, fn, topic string) (int, error) {
	var n int
	if err := pool.QueryRow(ctx, staleEpochSQL, fn, topic).Scan(&n); err != nil {
		return 0, fmt.Errorf("count stale-epoch commits: %w", err)
	}
	return n, nil
}
