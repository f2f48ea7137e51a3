package runtime_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	osexec "os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kfn-dev/kfn/internal/schema"
	"github.com/kfn-dev/kfn/runtime/kfntest"
)

// Workers built for an older schema, as real processes: the effects-worker
// built without the test-only migrations is at the real schema version N;
// built with -tags kfn_upgrade_test it also knows 9001 (additive) and 9002
// (breaks every worker before it), and -X schema.maxVersion caps it at 9001.
var (
	upgradeTestTag = "-tags=kfn_upgrade_test"
	capAt9001      = "-ldflags=-X github.com/kfn-dev/kfn/internal/schema.maxVersion=9001"
)

// A rolling upgrade under load: two workers built for schema N run while a
// newer release's migrator applies the additive migration 9001. They go on
// processing; one is restarted and starts on the newer schema; a worker
// built for 9001 then runs beside the old ones. Every record is applied
// exactly once (effects, inbox rows and events against what was produced).
// After the breaking migration 9002, the old worker still running turns not
// ready, and an old worker and a 9001 worker each refuse to start, naming
// the versions they run against.
func TestRollingUpgradeOldWorkersRunOnAnAdditiveMigrationAndRefuseABreakingOne(t *testing.T) {
	c := newCluster(t)
	own := schema.Latest()
	oldBin := kfntest.BuildBinary(t, effectsWorkerPkg)
	newBin := kfntest.BuildBinary(t, effectsWorkerPkg, upgradeTestTag, capAt9001)
	nextBin := kfntest.BuildBinary(t, effectsWorkerPkg, upgradeTestTag)

	w1, w2 := c.startWorkerFrom(oldBin, c.nextID()), c.startWorkerFrom(oldBin, c.nextID())
	prod := c.startProducer()
	c.waitBalanced(ids([]*proc{w1, w2}), 30*time.Second)

	c.migrateWith(newBin, "applied migrations [9001]; schema is at version 9001")
	// The old workers keep committing on every partition.
	at := c.cursors()
	waitUntil(t, 30*time.Second, "old workers to commit on every partition after migration 9001", func() (bool, string) {
		for p, cur := range c.cursors() {
			if cur.next <= at[p].next {
				return false, fmt.Sprintf("partition %d still at %d", p, cur.next)
			}
		}
		return true, ""
	})
	requireAlive(t, w1, w2)

	// Restarted, an old worker starts on the newer schema and says so.
	stopClean(t, w1)
	w3 := c.startWorkerFrom(oldBin, c.nextID())
	c.waitBalanced(ids([]*proc{w2, w3}), 30*time.Second)
	if log := w3.LogTail(200); !strings.Contains(log, `"schema":9001,"built_for":`+strconv.Itoa(own)) {
		t.Errorf("the restarted old worker did not log that it runs on schema 9001, built for %d:\n%s", own, log)
	}
	// A worker of the new release beside the old ones.
	w4 := c.startWorkerFrom(newBin, c.nextID())
	c.waitBalanced(ids([]*proc{w2, w3, w4}), 30*time.Second)
	time.Sleep(2 * time.Second) // work a while in this line-up
	requireAlive(t, w2, w3, w4)

	hw := c.finishProduction(prod)
	c.waitCaughtUp(hw, 60*time.Second)
	stopClean(t, w3, w4)
	c.check(hw)
	c.checkInboxHoldsEachRecordOnce(hw)

	// The breaking migration lands under the old worker still running: it
	// turns not ready, saying why.
	c.migrateWith(nextBin, "applied migrations [9002]; schema is at version 9002")
	broken := fmt.Sprintf("runs against versions %d to 9001 only", own)
	waitUntil(t, 30*time.Second, "the old worker's /readyz to fail on schema 9002", func() (bool, string) {
		code, body := readyz(t, w2)
		return code == http.StatusServiceUnavailable && strings.Contains(body, broken), fmt.Sprintf("%d %s", code, body)
	})
	stopClean(t, w2)
	for _, tc := range []struct {
		bin, want string
	}{
		{oldBin, fmt.Sprintf("built for schema version %d and runs against versions %d to 9001 only: migration 9002_upgrade_test_breaking breaks", own, own)},
		{newBin, "built for schema version 9001 and runs against versions 9001 to 9001 only: migration 9002_upgrade_test_breaking breaks"},
	} {
		p := c.startWorkerFrom(tc.bin, c.nextID())
		select {
		case <-p.Exited():
		case <-time.After(30 * time.Second):
			t.Fatalf("a worker built for an older schema did not stop on schema 9002")
		}
		if p.ExitErr() == nil || !strings.Contains(p.LogTail(20), tc.want) {
			t.Errorf("on schema 9002: exit %v, want an error containing %q; output:\n%s", p.ExitErr(), tc.want, p.LogTail(20))
		}
	}
}

// migrateWith runs `bin migrate` against the test database and requires
// its output to contain want.
func (c *cluster) migrateWith(bin, want string) {
	c.t.Helper()
	cmd := osexec.Command(bin, "migrate")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+c.pg.URL)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), want) {
		c.t.Fatalf("%s migrate: %v, output %q; want %q", bin, err, out, want)
	}
	c.t.Logf("migrate: %s", strings.TrimSpace(string(out)))
}

// checkInboxHoldsEachRecordOnce requires the inbox to hold one row for
// every produced offset of every partition, and no other.
func (c *cluster) checkInboxHoldsEachRecordOnce(hw map[int]int64) {
	c.t.Helper()
	for p, end := range hw {
		var rows, lo, hi int64
		err := c.pg.Pool.QueryRow(context.Background(), `SELECT count(*), coalesce(min("offset"), -1), coalesce(max("offset"), -1)
		                                                   FROM kfn.inbox JOIN kfn.lanes ON id = lane WHERE consumer = $1 AND topic = $2 AND partition = $3`,
			c.fn, c.topic, p).Scan(&rows, &lo, &hi)
		if err != nil {
			c.t.Fatal(err)
		}
		// (consumer, topic, partition, offset) is the inbox's key, so
		// end rows between 0 and end-1 are each offset once.
		if rows != end || lo != 0 || hi != end-1 {
			c.t.Errorf("partition %d: %d inbox rows for offsets %d..%d; want %d for 0..%d", p, rows, lo, hi, end, end-1)
		}
	}
}

// readyz returns the status and body of p's /readyz ("" until it serves).
func readyz(t *testing.T, p *proc) (int, string) {
	t.Helper()
	addr := p.metricsAddr()
	if addr == "" {
		return 0, "not serving yet"
	}
	client := http.Client{Timeout: 5 * time.Second}
	resp, err := client.Get("http://" + addr + "/readyz")
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err.Error()
	}
	return resp.StatusCode, string(body)
}
